"""ShardingClient against an in-process master: concurrency, lost workers, exactly-once restore."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from dlrover.client.sharding_client import ShardingClient
from dlrover.sharding import (
    DatasetSpec,
    DeliveryMode,
    ShardId,
    ShardingTimeoutError,
    ShardManager,
)
from dlrover.testing.sharding import InProcessTransport

DEADLINE_S = 20.0


class RecordingTransport(InProcessTransport):
    """Checks, at every hand-out, that no shard is given while another worker holds it."""

    def __init__(self, manager: ShardManager) -> None:
        super().__init__(manager)
        self.holders: dict[ShardId, str] = {}
        self.handouts: Counter[ShardId] = Counter()
        self.violations: list[str] = []
        self._record_lock = threading.Lock()

    def fetch_shards(self, dataset: str, worker_id: str, max_count: int):  # type: ignore[override]
        result = super().fetch_shards(dataset, worker_id, max_count)
        with self._record_lock:
            for shard in result.shards:
                if shard.id in self.holders:
                    self.violations.append(
                        f"{shard.id} given to {worker_id}, held by {self.holders[shard.id]}"
                    )
                self.holders[shard.id] = worker_id
                self.handouts[shard.id] += 1
        return result

    def report_done(self, dataset: str, worker_id: str, shard_ids):  # type: ignore[override]
        with self._record_lock:
            for shard_id in shard_ids:
                self.holders.pop(shard_id, None)
        return super().report_done(dataset, worker_id, shard_ids)


def run_worker(client: ShardingClient, counts: Counter[int], lock: threading.Lock) -> None:
    with client:
        while (shard := client.next_shard(DEADLINE_S)) is not None:
            trained = list(shard.indices())
            with lock:
                counts.update(trained)
            client.report_done(shard)


def test_many_concurrent_clients_never_share_a_leased_shard() -> None:
    transport = RecordingTransport(ShardManager())
    spec = DatasetSpec("d", size=20_000, shard_size=7, epochs=2, shuffle=True, seed=5)
    counts: Counter[int] = Counter()
    lock = threading.Lock()
    threads = [
        threading.Thread(
            target=run_worker,
            args=(
                ShardingClient(transport, spec, f"n{i}/0", prefetch=3, poll_interval_s=0.001),
                counts,
                lock,
            ),
        )
        for i in range(32)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE_S)
        assert not thread.is_alive()
    assert transport.violations == []
    assert set(transport.handouts.values()) == {1}
    assert counts == Counter({i: 2 for i in range(20_000)})


def test_killed_worker_mid_shard_every_sample_trained_at_least_once() -> None:
    transport = InProcessTransport(ShardManager())
    spec = DatasetSpec("d", size=2_000, shard_size=50, lease_s=60.0)
    counts: Counter[int] = Counter()
    lock = threading.Lock()
    victim = ShardingClient(transport, spec, "n0/0", prefetch=2).start()
    shard = victim.next_shard(DEADLINE_S)
    assert shard is not None
    with lock:
        counts.update(list(shard.indices())[:20])  # dies 20 samples into its shard
    victim.close()  # the process is gone: its prefetched shards stay leased to it
    survivors = [ShardingClient(transport, spec, f"n{i}/0", poll_interval_s=0.001) for i in (1, 2)]
    threads = [threading.Thread(target=run_worker, args=(c, counts, lock)) for c in survivors]
    for thread in threads:
        thread.start()
    # The master learns of the failure (the agent reports the node) while the others train.
    assert transport.recover_worker("n0/0") in (2, 3)  # its shard + 1 or 2 prefetched
    for thread in threads:
        thread.join(DEADLINE_S)
        assert not thread.is_alive()
    assert set(counts) == set(range(2_000)) and min(counts.values()) >= 1
    assert sum(counts.values()) == 2_000 + 20  # only the killed shard's start was redone


def test_stuck_worker_loses_its_lease_to_a_live_one() -> None:
    clock = [0.0]
    transport = InProcessTransport(ShardManager(clock=lambda: clock[0]))
    spec = DatasetSpec("d", size=100, shard_size=10, lease_s=30.0)
    stuck = ShardingClient(transport, spec, "n0/0", prefetch=10).start()
    assert stuck.next_shard(DEADLINE_S) is not None
    live = ShardingClient(transport, spec, "n1/0", poll_interval_s=0.001).start()
    with pytest.raises(ShardingTimeoutError, match="n1/0 waited"):
        live.next_shard(timeout_s=0.2)  # everything is leased to the stuck worker
    stuck.close()
    clock[0] = 31.0
    assert transport.tick() == 10
    seen: set[int] = set()
    while (shard := live.next_shard(DEADLINE_S)) is not None:
        seen.update(shard.indices())
        live.report_done(shard)
    live.close()
    assert seen == set(range(100))


def test_exactly_once_with_checkpoint_and_restore() -> None:
    """Three workers train in lockstep; a checkpoint is taken at a step, the job crashes
    later, and restarts from the checkpoint. Samples in the final model: each exactly once."""
    manager = ShardManager()
    transport = InProcessTransport(manager)
    spec = DatasetSpec("d", size=600, shard_size=16, shuffle=True, mode=DeliveryMode.EXACTLY_ONCE)
    micro = 4

    def start_workers() -> list[tuple[ShardingClient, list]]:
        return [(ShardingClient(transport, spec, f"n{i}/0").start(), []) for i in range(3)]

    def step(worker: tuple[ShardingClient, list], model: Counter[int]) -> bool:
        """One micro-batch; `cursor` holds [shard, iterator, consumed] of the open shard."""
        client, cursor = worker
        for _ in range(micro):
            while not cursor or cursor[2] == len(cursor[0]) - cursor[0].offset:
                if cursor:
                    client.report_done(cursor[0])
                shard = client.next_shard(DEADLINE_S)
                if shard is None:
                    cursor.clear()
                    return False
                cursor[:] = [shard, shard.indices(), 0]
            model[next(cursor[1])] += 1
            cursor[2] += 1
        return True

    model: Counter[int] = Counter()
    workers = start_workers()
    for _ in range(7):
        for worker in workers:
            step(worker, model)
    # Checkpoint: every rank reports its partial shard, then the position is read.
    for client, cursor in workers:
        client.report_progress(cursor[0], cursor[0].offset + cursor[2])
    position = manager.get_position("d")
    checkpointed_model = Counter(model)
    for _ in range(5):  # trained after the checkpoint, then lost in the crash
        for worker in workers:
            step(worker, model)
    for client, _ in workers:
        client.close()
    # Restart: a new incarnation of every worker restores the checkpoint (only one applies).
    model = checkpointed_model
    workers = start_workers()
    applied = [client.restore_position(position, token="step7@1") for client, _ in workers]
    assert applied == [True, False, False]
    lock = threading.Lock()

    def train_to_end(worker: tuple[ShardingClient, list]) -> None:
        local: Counter[int] = Counter()
        while step(worker, local):
            pass
        with lock:
            model.update(local)

    # After the restart workers run freely (a worker may wait for another's last shard).
    threads = [threading.Thread(target=train_to_end, args=(w,)) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE_S)
        assert not thread.is_alive()
    for client, _ in workers:
        client.close()
    assert model == Counter({i: 1 for i in range(600)})
    assert manager.dataset_progress("d").finished


class GatedTransport(InProcessTransport):
    """Every fetch after the first blocks until the test opens the gate: a stalled master."""

    def __init__(self, manager: ShardManager) -> None:
        super().__init__(manager)
        self.gate = threading.Event()
        self.stalled = threading.Event()
        self.fetches = 0

    def fetch_shards(self, dataset: str, worker_id: str, max_count: int):  # type: ignore[override]
        self.fetches += 1
        if self.fetches > 1:
            self.stalled.set()
            assert self.gate.wait(DEADLINE_S)
        return super().fetch_shards(dataset, worker_id, max_count)


def test_prefetched_shards_are_served_while_the_master_is_stalled() -> None:
    transport = GatedTransport(ShardManager())
    spec = DatasetSpec("d", size=100, shard_size=10)
    client = ShardingClient(transport, spec, "n0/0", prefetch=3).start()
    first = client.next_shard(DEADLINE_S)
    assert transport.stalled.wait(DEADLINE_S)  # the prefetcher is now stuck in an RPC
    # The two shards already queued come without touching the master.
    served = [client.next_shard(timeout_s=1.0), client.next_shard(timeout_s=1.0)]
    assert [s.id.index for s in (first, *served) if s is not None] == [0, 1, 2]
    with pytest.raises(ShardingTimeoutError):
        client.next_shard(timeout_s=0.1)
    transport.gate.set()
    for shard in (first, *served):
        assert shard is not None
        client.report_done(shard)
    rest = []
    while (shard := client.next_shard(DEADLINE_S)) is not None:
        rest.append(shard.id.index)
        client.report_done(shard)
    client.close()
    assert rest == list(range(3, 10))
