"""DynamicShardSampler in lockstep: the same count on every rank, every epoch, restores at
another world size, and a clear error instead of a hang."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from dlrover.api.errors import MasterUnreachableError
from dlrover.client.sharding import connect
from dlrover.client.sharding_client import ShardingClient
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.server import MasterServer
from dlrover.master.state_store import MemoryStateStore
from dlrover.sharding import (
    DatasetSpec,
    DeliveryMode,
    Position,
    ShardManager,
    ShardRetriesExhaustedError,
)
from dlrover.sharding.lockstep import LockstepError, lockstep_quota, shards_left
from dlrover.sharding.permutation import permute, unpermute
from dlrover.sharding.types import FetchResult
from dlrover.testing.sharding import InProcessTransport
from dlrover.trainer.torch.elastic.client_factory import NoMasterError
from dlrover.trainer.torch.elastic.dynamic_sampler import DynamicShardSampler

DEADLINE_S = 30.0


class CountingTransport(InProcessTransport):
    """Counts the shards each worker leased of each dataset."""

    def __init__(self, manager: ShardManager) -> None:
        super().__init__(manager)
        self.leased: Counter[tuple[str, str]] = Counter()

    def fetch_shards(self, dataset: str, worker_id: str, max_count: int) -> FetchResult:
        result = super().fetch_shards(dataset, worker_id, max_count)
        self.leased[(dataset, worker_id)] += len(result.shards)
        return result


def on_ranks(world: int, body: Callable[[int], Any]) -> list[Any]:
    """Run ``body(rank)`` on ``world`` threads at once; re-raise the first failure."""
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as error:  # handed to the test thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE_S)
        assert not thread.is_alive(), "a rank hung"
    if errors:
        raise errors[0]
    return results


def sampler(transport: Any, size: int, world: int, rank: int, **kwargs: Any) -> DynamicShardSampler:
    kwargs.setdefault("shard_size", 7)
    return DynamicShardSampler(
        range(size),
        world,
        rank,
        transport=transport,
        dataset_name="d",
        worker_id=f"n{rank}/0",
        **kwargs,
    )


# --- the quota policy -------------------------------------------------------------------------
@pytest.mark.parametrize("size,shard", [(103, 7), (100, 10), (5, 7), (64, 1), (0, 3)])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_no_rank_can_overrun_its_quota_and_all_shards_fit(
    size: int, shard: int, world: int, drop_last: bool
) -> None:
    spec = DatasetSpec(name="d", size=size, shard_size=shard, shuffle=True, seed=3)
    rng = random.Random(size * 31 + world)
    positions: list[Position | None] = [None]
    for _ in range(5):  # random restored places: a cursor and some partly read shards
        cursor = rng.randint(0, spec.num_shards)
        done = [spec.shard_index(0, ordinal) for ordinal in range(cursor)]
        pending = rng.sample(done, min(len(done), rng.randint(0, 3)))
        positions.append(
            Position(
                "d", 0, cursor, tuple((0, i, rng.randint(0, spec.shard_length(i))) for i in pending)
            )
        )
    for position in positions:
        quota = lockstep_quota(spec, world, drop_last, position)
        whole, others = shards_left(spec, position)
        lengths = [shard] * whole + others
        assert quota.shards_left == len(lengths) and quota.samples_left == sum(lengths)
        # The most any rank can draw: its quota of the longest shards left.
        assert quota.samples == sum(sorted(lengths, reverse=True)[: quota.shards])
        if drop_last:
            assert quota.shards == len(lengths) // world
        else:
            assert quota.shards * world >= len(lengths)
            assert (quota.shards - 1) * world < len(lengths) or not lengths
    if size and not drop_last:
        # Fresh epochs: as DistributedSampler, one rank reads the whole dataset.
        assert lockstep_quota(spec, 1).samples == size


def test_the_short_last_shard_is_found_among_the_shards_left_in_a_shuffled_order() -> None:
    spec = DatasetSpec(name="d", size=95, shard_size=10, shuffle=True, seed=11)
    ordinal = spec.shard_ordinal(0, 9)
    assert spec.shard_index(0, ordinal) == 9
    assert shards_left(spec, Position("d", 0, ordinal)) == (10 - ordinal - 1, [5])
    assert shards_left(spec, Position("d", 0, ordinal + 1)) == (10 - ordinal - 1, [])


# --- lockstep iterations ----------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("size,drop_last", [(103, False), (100, False), (103, True), (9, False)])
def test_every_rank_yields_its_length_and_every_epoch_covers_the_dataset(
    world: int, size: int, drop_last: bool
) -> None:
    transport = CountingTransport(ShardManager())
    epochs = 3

    def rank_body(rank: int) -> list[list[int]]:
        s = sampler(transport, size, world, rank, drop_last=drop_last, shuffle=True, seed=5)
        out = []
        for epoch in range(epochs):  # DLRover's loop: set_epoch, then one pass
            s.set_epoch(epoch)
            expected = len(s)
            got = list(s)
            assert len(got) == expected
            out.append(got)
        s.close()
        return out

    per_rank = on_ranks(world, rank_body)
    for epoch in range(epochs):
        counts = {len(per_rank[rank][epoch]) for rank in range(world)}
        assert len(counts) == 1, f"epoch {epoch}: ranks yield {counts}"
        seen = Counter(i for rank in range(world) for i in per_rank[rank][epoch])
        quota = lockstep_quota(DatasetSpec(name="d", size=size, shard_size=7), world, drop_last)
        if drop_last:
            # Whole shards of the quota are read; the few shards over it wait.
            assert len(seen) >= quota.shards * world * 7 - 7
        else:
            assert set(seen) == set(range(size)), f"epoch {epoch} lost samples"
        for rank in range(world):
            assert transport.leased[(f"d/epoch-{epoch}", f"n{rank}/0")] <= quota.shards
    # The shuffle differs per epoch (seed + epoch).
    assert per_rank[0][0] != per_rank[0][1] or size < 10


def test_a_restore_mid_epoch_at_another_world_size_trains_the_rest_in_lockstep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three ranks read epoch 0 and part of epoch 1; rank 0's checkpoint is from epoch 0. The
    job restarts with two ranks that load it: they read the rest of epoch 0 (exactly once, with
    a partly read shard) and all of epoch 1 again (its first reads went into the lost model)."""
    size = 200
    transport = InProcessTransport(ShardManager())
    trained: dict[int, Counter[int]] = {0: Counter(), 1: Counter()}
    lock = threading.Lock()
    checkpoint: dict[str, Any] = {}
    step_at = 9  # micro-batches of 2: not a shard boundary (shards of 7)

    def first_attempt(rank: int) -> None:
        s = sampler(transport, size, 3, rank, mode=DeliveryMode.EXACTLY_ONCE)
        batches: list[list[int]] = []
        it = iter(s)
        for index in it:  # micro-batches of 2, in lockstep by construction of the barrier
            if not batches or len(batches[-1]) == 2:
                batches.append([])
            batches[-1].append(index)
            if len(batches) == step_at + 1 and len(batches[-1]) == 1:
                barrier.wait(DEADLINE_S)  # every rank trained step_at batches
                if rank == 0:
                    checkpoint.update(s.state_dict(step_at, 2))
                barrier.wait(DEADLINE_S)
        with lock:
            trained[0].update(i for batch in batches[:step_at] for i in batch)
        s.set_epoch(1)
        for count, _ in enumerate(s):
            if count == 20:
                break  # the crash: epoch 1 partly read
        s.close()

    barrier = threading.Barrier(3)
    on_ranks(3, first_attempt)
    assert checkpoint["epoch"] == 0
    for rank in range(3):
        transport.recover_worker(f"n{rank}/0")  # the master recovers the lost workers
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")

    def second_attempt(rank: int) -> list[list[int]]:
        s = sampler(transport, size, 2, rank, mode=DeliveryMode.EXACTLY_ONCE)
        s.load_state_dict(checkpoint)
        out = []
        for epoch in (0, 1):
            s.set_epoch(epoch)
            expected = len(s)
            got = list(s)
            assert len(got) == expected
            out.append(got)
        s.close()
        return out

    after = on_ranks(2, second_attempt)
    for epoch in (0, 1):
        assert len(after[0][epoch]) == len(after[1][epoch])
        trained[epoch].update(after[0][epoch] + after[1][epoch])
        assert set(trained[epoch]) == set(range(size)), f"epoch {epoch} lost samples"
    # Epoch 0 after the restore: the rest of the epoch plus padding, which is at most a shard
    # per rank and the part already read of each of the three partly read shards.
    rest = size - 3 * step_at * 2
    assert rest <= len(after[0][0]) + len(after[1][0]) <= rest + (2 + 3) * 7


def test_a_restart_that_restores_nothing_trains_the_epoch_from_its_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Exactly-once: the first start trains a step (its progress is on the master), a node is
    lost before any checkpoint every node could load, and the next start loads nothing, so its
    model starts over: every sample must be read again, none skipped (found by
    benchmarks/fault_campaign.py: the restarted start resumed the master's half-read shards
    from their offsets, and 12 samples never reached the model)."""
    size, step_at = 48, 2
    transport = InProcessTransport(ShardManager())

    def first_attempt(rank: int) -> None:
        s = sampler(transport, size, 3, rank, mode=DeliveryMode.EXACTLY_ONCE, shard_size=8)
        it = iter(s)
        for _ in range(step_at):
            next(it)
        s.state_dict(step_at, 1)  # the flash checkpoint that no node could load later
        s.close()

    on_ranks(3, first_attempt)
    for rank in range(3):
        transport.recover_worker(f"n{rank}/0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")

    def second_attempt(rank: int) -> list[int]:
        s = sampler(transport, size, 3, rank, mode=DeliveryMode.EXACTLY_ONCE, shard_size=8)
        got = list(s)
        s.close()
        return got

    after = on_ranks(3, second_attempt)
    assert sorted(i for got in after for i in got) == list(range(size))


def test_ranks_that_disagree_on_the_count_raise_instead_of_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    transport = InProcessTransport(ShardManager())
    first = sampler(transport, 100, 2, 0)
    it = iter(first)
    taken = [next(it) for _ in range(30)]
    state = first.state_dict(15, 2)
    first.close()
    assert len(taken) == 30
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restored = sampler(transport, 100, 2, 0)
    restored.load_state_dict(state)  # rank 0 alone loads the checkpoint
    not_restored = sampler(transport, 100, 2, 1)
    assert len(restored) != len(not_restored)
    next(iter(restored))
    with pytest.raises(LockstepError, match="rank 1 would read 56, the first rank 42"):
        next(iter(not_restored))


def test_a_peer_that_died_holding_leases_does_not_stall_a_rank() -> None:
    transport = InProcessTransport(ShardManager())
    dead = sampler(transport, 70, 2, 1, prefetch=3)
    it = iter(dead)
    next(it)  # leased three shards, then the process died (its leases stay)
    alive = sampler(transport, 70, 2, 0)
    started = time.monotonic()
    got = list(alive)
    assert len(got) == len(alive) == 35
    assert time.monotonic() - started < DEADLINE_S
    dead.close()


# --- errors -----------------------------------------------------------------------------------
def test_without_a_master_the_sampler_says_what_to_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DLROVER_MASTER_ADDR", raising=False)
    with pytest.raises(NoMasterError, match="dlrover-run.*ElasticDistributedSampler"):
        DynamicShardSampler(range(10), 1, 0)


def test_epochs_outside_the_range_and_cumulative_steps_are_clear_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    transport = InProcessTransport(ShardManager())
    bounded = sampler(transport, 20, 1, 0, num_epochs=2)
    with pytest.raises(ValueError, match="num_epochs=2"):
        bounded.set_epoch(2)
    unbounded = sampler(transport, 20, 1, 0)
    unbounded.set_epoch(500)  # every epoch the loop asks for
    assert len(list(unbounded)) == 20
    with pytest.raises(ValueError, match="micro-batches of the current pass"):
        unbounded.state_dict(step=11, micro_batch_size=2)  # a global step, not this epoch's
    state = unbounded.state_dict(step=10, micro_batch_size=2)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    resumed = sampler(transport, 20, 1, 0)
    resumed.load_state_dict(state)
    with pytest.raises(ValueError, match="restored at epoch 500"):
        resumed.set_epoch(3)
    assert len(resumed) == 0  # the checkpoint was taken at the end of epoch 500
    resumed.set_epoch(501)
    assert len(list(resumed)) == 20


def test_a_master_gone_past_the_reconnect_window_is_a_clear_error() -> None:
    server = MasterServer(JobMaster(JobMasterConfig(), MemoryStateStore()), "t", "127.0.0.1", 0)
    server.start()
    try:
        # A master that comes back within the window is waited for (test_sharding_grpc.py).
        transport = connect(f"127.0.0.1:{server.port}", "t", reconnect_s=1.0)
        s = sampler(transport, 30, 1, 0, shard_size=5)
        assert sorted(s) == list(range(30))
    finally:
        server.stop(0.1)
    started = time.monotonic()
    with pytest.raises(MasterUnreachableError, match="master at 127.0.0.1.* did not answer"):
        list(s)  # epoch 1: the master is gone
    assert time.monotonic() - started < DEADLINE_S


def test_unpermute_inverts_permute() -> None:
    for n, seed in [(1, 0), (2, 1), (3, 7), (17, 5), (1000, 12345)]:
        assert [unpermute(permute(i, n, seed), n, seed) for i in range(n)] == list(range(n))


def test_a_client_leases_no_more_than_its_budget_and_stops_when_told() -> None:
    transport = CountingTransport(ShardManager())
    spec = DatasetSpec(name="b", size=100, shard_size=5)
    budget = ShardingClient(transport, spec, "w0", prefetch=4, max_shards=3).start()
    got = [budget.next_shard(DEADLINE_S) for _ in range(4)]
    assert [shard is not None for shard in got] == [True, True, True, False]
    stopper = ShardingClient(transport, spec, "w1", prefetch=2).start()
    first = stopper.next_shard(DEADLINE_S)
    stopper.stop_fetching()
    queued = []
    while (shard := stopper.next_shard(DEADLINE_S)) is not None:
        queued.append(shard)
    budget.close()
    stopper.close()
    assert first is not None and len(queued) <= 2
    assert transport.leased[("b", "w0")] == 3
    assert transport.leased[("b", "w1")] == 1 + len(queued)


def test_a_shard_lost_too_often_stops_the_pass_with_the_masters_reason() -> None:
    transport = InProcessTransport(ShardManager())
    reader = sampler(transport, 14, 1, 0)
    spec = reader.epoch_spec(0)
    transport.register_dataset(spec)
    for _ in range(spec.max_retries + 1):  # a worker that dies holding shard 0, each time
        assert transport.fetch_shards(spec.name, "doomed/0", 1).shards
        transport.recover_worker("doomed/0")
    with pytest.raises(ShardRetriesExhaustedError, match="max_retries=5"):
        list(reader)
    reader.close()
