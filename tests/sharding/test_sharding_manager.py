"""Unit tests of the pure sharding master: registry, leases, recovery, retries, state, position."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from dlrover.sharding import (
    DatasetConflictError,
    DatasetSpec,
    DeliveryMode,
    InvalidPositionError,
    InvalidSpecError,
    ShardId,
    ShardManager,
    ShardRetriesExhaustedError,
    UnknownDatasetError,
)
from dlrover.sharding.permutation import permute


class Clock:
    """A hand-stepped clock for lease deadlines."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def drain(manager: ShardManager, name: str, worker: str = "w") -> Counter[int]:
    """Fetch and complete every remaining shard as one worker; count samples."""
    counts: Counter[int] = Counter()
    while True:
        result = manager.fetch_shards(name, worker, 4)
        if not result.shards:
            assert result.finished
            return counts
        for shard in result.shards:
            counts.update(shard.indices())
        manager.report_done(name, worker, [s.id for s in result.shards])


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_sample_once_per_epoch(shuffle: bool) -> None:
    manager = ShardManager(clock=Clock())
    manager.register_dataset(DatasetSpec("d", size=1003, shard_size=10, epochs=3, shuffle=shuffle))
    counts = drain(manager, "d")
    assert counts == Counter({i: 3 for i in range(1003)})


def test_shuffle_changes_order_per_epoch_and_is_seeded() -> None:
    def order(seed: int) -> list[tuple[int, int]]:
        manager = ShardManager(clock=Clock())
        manager.register_dataset(
            DatasetSpec("d", size=100, shard_size=10, epochs=2, shuffle=True, seed=seed)
        )
        return [(s.id.epoch, s.id.index) for s in manager.fetch_shards("d", "w", 20).shards]

    first = order(7)
    assert first == order(7)
    assert first != order(8)
    epoch0 = [index for epoch, index in first if epoch == 0]
    epoch1 = [index for epoch, index in first if epoch == 1]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1 and epoch0 != list(range(10))


def test_permutation_is_a_bijection() -> None:
    for n in (1, 2, 3, 5, 64, 1000, 4097):
        assert sorted(permute(i, n, 42) for i in range(n)) == list(range(n))


def test_batch_size_times_batches_per_shard() -> None:
    spec = DatasetSpec("d", size=100, batch_size=4, batches_per_shard=5)
    assert spec.samples_per_shard == 20 and spec.num_shards == 5


def test_bad_specs_are_refused_with_the_field_named() -> None:
    with pytest.raises(InvalidSpecError, match="epochs"):
        DatasetSpec("d", size=10, shard_size=2, epochs=0)
    with pytest.raises(InvalidSpecError, match="shard_size"):
        DatasetSpec("d", size=10)
    with pytest.raises(UnknownDatasetError, match="register_dataset"):
        ShardManager().fetch_shards("nope", "w")


def test_reregistration_is_a_noop_and_conflict_is_an_error() -> None:
    manager = ShardManager(clock=Clock())
    spec = DatasetSpec("d", size=100, shard_size=10)
    assert manager.register_dataset(spec).created
    held = manager.fetch_shards("d", "w0", 3).shards
    manager.report_done("d", "w0", [held[0].id])
    # A restarted worker registers again: progress and leases survive.
    assert not manager.register_dataset(spec).created
    progress = manager.dataset_progress("d")
    assert (progress.done_shards, progress.leased, progress.todo) == (1, 2, 7)
    with pytest.raises(DatasetConflictError, match="already registered"):
        manager.register_dataset(DatasetSpec("d", size=200, shard_size=10))


def test_lost_worker_shards_go_to_the_head_of_the_queue() -> None:
    manager = ShardManager(clock=Clock())
    manager.register_dataset(DatasetSpec("d", size=100, shard_size=10))
    lost = manager.fetch_shards("d", "w0", 2).shards
    manager.fetch_shards("d", "w1", 1)
    assert manager.recover_worker("w0") == 2
    again = manager.fetch_shards("d", "w1", 2).shards
    assert [s.id for s in again] == [s.id for s in lost]
    assert all(s.attempt == 1 for s in again)


def test_expired_lease_is_reassigned_on_tick() -> None:
    clock = Clock()
    manager = ShardManager(clock=clock)
    manager.register_dataset(DatasetSpec("d", size=30, shard_size=10, lease_s=5.0))
    (shard,) = manager.fetch_shards("d", "slow", 1).shards
    clock.now += 4.9
    assert manager.tick() == 0
    assert manager.renew_leases("d", "slow") == 1  # renewed: deadline now + 5
    clock.now += 4.9
    assert manager.tick() == 0
    clock.now += 0.2
    assert manager.tick() == 1
    (taken,) = manager.fetch_shards("d", "fast", 1).shards
    assert taken.id == shard.id and taken.attempt == 1
    # The slow worker finishing late still counts; the new holder's report is then ignored.
    assert manager.report_done("d", "slow", [shard.id]).accepted == 1
    assert manager.report_done("d", "fast", [shard.id]).ignored == 1


def test_retries_are_bounded_and_the_error_names_the_shard() -> None:
    manager = ShardManager(clock=Clock())
    manager.register_dataset(DatasetSpec("d", size=30, shard_size=10, max_retries=2))
    for attempt in range(3):
        (shard,) = manager.fetch_shards("d", f"w{attempt}", 1).shards
        assert shard.id == ShardId(0, 0) and shard.attempt == attempt
        manager.recover_worker(f"w{attempt}")
    with pytest.raises(ShardRetriesExhaustedError, match=r"epoch 0 shard 0 \(samples \[0, 10\)\)"):
        manager.fetch_shards("d", "w9", 1)


def test_state_of_1e8_samples_is_kilobytes() -> None:
    manager = ShardManager(clock=Clock())
    spec = DatasetSpec("big", size=100_000_000, shard_size=1, epochs=3, shuffle=True, seed=1)
    manager.register_dataset(spec)
    for worker in range(64):
        shards = manager.fetch_shards("big", f"node{worker}/0", 4).shards
        manager.report_done("big", f"node{worker}/0", [shards[0].id])
    manager.recover_worker("node3/0")
    text = json.dumps(manager.to_state())
    assert len(text) < 32 * 1024, len(text)
    assert len(json.dumps(manager.get_position("big").to_dict())) < 8 * 1024


def test_state_round_trip_continues_where_it_stopped() -> None:
    clock = Clock()
    manager = ShardManager(clock=clock)
    manager.register_dataset(DatasetSpec("d", size=95, shard_size=10, epochs=2, shuffle=True))
    counts: Counter[int] = Counter()
    for shard in manager.fetch_shards("d", "w0", 5).shards[:3]:
        counts.update(shard.indices())
        manager.report_done("d", "w0", [shard.id])
    restored = ShardManager.from_state(json.loads(json.dumps(manager.to_state())), clock=clock)
    restored.recover_worker("w0")  # the two unfinished leases survived the restart
    counts.update(drain(restored, "d"))
    assert counts == Counter({i: 2 for i in range(95)})


def test_exactly_once_position_restores_partial_shards() -> None:
    manager = ShardManager(clock=Clock())
    manager.register_dataset(
        DatasetSpec("d", size=50, shard_size=10, shuffle=True, mode=DeliveryMode.EXACTLY_ONCE)
    )
    trained: Counter[int] = Counter()
    first, second = manager.fetch_shards("d", "w", 2).shards
    trained.update(first.indices())
    manager.report_done("d", "w", [first.id])
    trained.update(list(second.indices())[:4])
    manager.report_progress("d", "w", second.id, 4)
    position = manager.get_position("d")
    # After the checkpoint: more training that the crash throws away.
    third = manager.fetch_shards("d", "w", 1).shards[0]
    manager.report_done("d", "w", [second.id, third.id])
    assert manager.restore_position(position, token="ckpt-1")
    assert not manager.restore_position(position, token="ckpt-1")  # other ranks: no-op
    trained.update(drain(manager, "d"))
    assert trained == Counter({i: 1 for i in range(50)})


def test_position_is_canonical_under_racing_fetches() -> None:
    manager = ShardManager(clock=Clock())
    manager.register_dataset(DatasetSpec("d", size=100, shard_size=10, epochs=2, shuffle=True))
    shards = manager.fetch_shards("d", "w", 10).shards
    manager.report_done("d", "w", [s.id for s in shards])
    before = manager.get_position("d")
    manager.fetch_shards("d", "w", 3)  # crosses into epoch 1, nothing consumed
    assert manager.get_position("d") == before


def test_bad_position_is_refused() -> None:
    manager = ShardManager(clock=Clock())
    manager.register_dataset(DatasetSpec("d", size=100, shard_size=10))
    position = manager.get_position("d")
    bad = type(position)("d", epoch=0, cursor=11)
    with pytest.raises(InvalidPositionError, match="cursor 11"):
        manager.restore_position(bad)


@pytest.mark.parametrize("mode", [DeliveryMode.EXACTLY_ONCE, DeliveryMode.AT_LEAST_ONCE])
def test_position_at_a_step_ignores_what_workers_did_after_it(mode: DeliveryMode) -> None:
    """Rank 0 alone asks for the position at step s while rank 1 has already finished a shard
    and started another: that work is not in the position, so restoring it loses nothing."""
    from dlrover.sharding.types import ConsumptionMark

    spec = DatasetSpec(name="d", size=100, shard_size=10, mode=mode)
    manager = ShardManager(Clock())
    manager.register_dataset(spec)
    a, b = (manager.fetch_shards("d", w, 1).shards[0] for w in ("w0", "w1"))
    manager.mark_consumption("d", "w0", ConsumptionMark(0, 0, a.id, 0))
    manager.mark_consumption("d", "w1", ConsumptionMark(0, 0, b.id, 0))
    # Both trained 10 samples; w1 raced on: b done, c started and finished, d started.
    manager.report_done("d", "w0", [a.id])
    c, d = manager.fetch_shards("d", "w1", 2).shards
    manager.report_done("d", "w1", [b.id])
    manager.mark_consumption("d", "w1", ConsumptionMark(0, 10, c.id, 0))
    manager.report_done("d", "w1", [c.id])
    manager.mark_consumption("d", "w1", ConsumptionMark(0, 20, d.id, 0))
    # w0 has not got past sample 10 yet: asking for step "15 samples" waits for it.
    assert manager.position_at("d", 0, 15).waiting_for == ("w0",)
    answer = manager.position_at("d", 0, 6)
    assert answer.waiting_for == () and answer.position is not None
    exact = mode is DeliveryMode.EXACTLY_ONCE
    pending = {(e, i): o for e, i, o in answer.position.pending}
    # At least once, a half-read shard is read again whole: the same as not read at all.
    assert pending.get((0, a.id.index), 0) == (6 if exact else 0)
    assert pending.get((0, b.id.index), 0) == (6 if exact else 0)
    # Restore into a fresh master and read the rest: every sample not trained by step 6 comes.
    fresh = ShardManager(Clock())
    fresh.register_dataset(spec)
    fresh.restore_position(answer.position)
    counts = drain(fresh, "d")
    trained_by_step = set()
    for shard in (a, b):
        trained_by_step.update(list(shard.indices())[:6])
    assert set(counts) | trained_by_step == set(range(100))
    if exact:
        assert not set(counts) & trained_by_step


def test_position_at_counts_an_ended_iteration_and_a_lost_worker() -> None:
    from dlrover.sharding.types import ConsumptionMark

    manager = ShardManager(Clock())
    manager.register_dataset(DatasetSpec(name="d", size=40, shard_size=10))
    s0 = manager.fetch_shards("d", "w0", 1).shards[0]
    s1 = manager.fetch_shards("d", "w1", 1).shards[0]
    manager.mark_consumption("d", "w0", ConsumptionMark(0, 0, s0.id, 0))
    manager.mark_consumption("d", "w1", ConsumptionMark(0, 0, s1.id, 0))
    manager.report_done("d", "w1", [s1.id])
    manager.mark_consumption("d", "w1", ConsumptionMark(0, 10))  # w1 ran out: ended at 10
    answer = manager.position_at("d", 0, 10)  # w0 reached 10, w1 ended: both count
    assert answer.position is not None
    assert answer.position.pending == ()  # nothing left half-done
    assert manager.position_at("d", 0, 12).waiting_for == ("w0",)
    manager.recover_worker("w0")  # a lost worker's marks go with its leases
    assert manager.position_at("d", 0, 12).waiting_for == ()
    with pytest.raises(InvalidSpecError, match="does not exist"):
        manager.mark_consumption("d", "w0", ConsumptionMark(0, 0, ShardId(0, 99), 0))


def test_a_worker_s_renewal_and_loss_reach_its_own_leases_only() -> None:
    from dlrover.sharding.leases import Lease, LeaseTable

    table: LeaseTable[int] = LeaseTable()
    for key in range(6):
        table.grant(key, Lease(f"w{key % 3}", deadline=1.0, attempt=0))
    assert table.renew("w1", 5.0) == 2
    assert sorted(k for k, lease in table.items() if lease.deadline == 5.0) == [1, 4]
    assert table.held_by("w2") == [2, 5] and table.held_by("nobody") == []
    table.release(2)
    table.grant(2, Lease("w0", deadline=1.0, attempt=1))  # handed to another worker
    assert table.held_by("w2") == [5] and table.held_by("w0") == [0, 3, 2]
    table.release(5)
    assert table.renew("w2", 9.0) == 0 and table.held_by("w2") == []
    table.clear()
    assert table.held_by("w0") == [] and len(table) == 0
