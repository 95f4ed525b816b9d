"""Streaming source: (partition, offset range) shards with the same lease and recovery logic."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from dlrover.sharding import InMemoryStreamSource, InvalidSpecError, ShardManager, StreamSpec
from dlrover.sharding.stream import StreamPosition


def test_stream_shards_cover_every_record_once_despite_a_lost_worker() -> None:
    clock = [0.0]
    manager = ShardManager(clock=lambda: clock[0])
    source = InMemoryStreamSource(num_partitions=3)
    manager.register_stream(StreamSpec("s", records_per_shard=5, lease_s=10.0), source)
    for partition, count in ((0, 12), (1, 7), (2, 0)):
        source.append(partition, count)
    lost = manager.fetch_stream_shards("s", "w0", 2).shards
    assert manager.recover_worker("w0") == 2
    seen: Counter[tuple[int, int]] = Counter()
    first = manager.fetch_stream_shards("s", "w1", 2).shards
    assert [(s.partition, s.start) for s in first] == [(s.partition, s.start) for s in lost]
    pending = list(first)
    source.append(2, 4)  # the stream grows while it is read
    while True:
        pending += manager.fetch_stream_shards("s", "w1", 4).shards
        if not pending:
            break
        for shard in pending:
            seen.update((shard.partition, offset) for offset in range(shard.start, shard.end))
        manager.report_stream_done("s", "w1", [(s.partition, s.start) for s in pending])
        pending = []
    expected = {(p, o) for p, n in ((0, 12), (1, 7), (2, 4)) for o in range(n)}
    assert set(seen) == expected and set(seen.values()) == {1}
    assert manager.stream_committed("s") == {0: 12, 1: 7, 2: 4}


def test_stream_lease_timeout_state_and_restore() -> None:
    clock = [0.0]
    source = InMemoryStreamSource(num_partitions=2)
    source.append(0, 20)
    source.append(1, 20)
    manager = ShardManager(clock=lambda: clock[0])
    manager.register_stream(StreamSpec("s", records_per_shard=10, lease_s=1.0), source)
    a, b = manager.fetch_stream_shards("s", "w0", 2).shards
    manager.report_stream_done("s", "w0", [(a.partition, a.start)])
    assert manager.stream_committed("s")[b.partition] == b.start
    clock[0] = 2.0
    assert manager.tick() == 1
    state = json.loads(json.dumps(manager.to_state()))
    restored = ShardManager.from_state(state, clock=lambda: clock[0], sources={"s": source})
    (again,) = restored.fetch_stream_shards("s", "w1", 1).shards
    assert (again.partition, again.start, again.attempt) == (b.partition, b.start, 1)
    restored.restore_stream(StreamPosition("s", ((0, 0), (1, 0))))
    assert restored.stream_committed("s") == {0: 0, 1: 0}


def test_a_former_holder_cannot_end_or_mark_a_range_leased_again() -> None:
    from dlrover.sharding.stream import StreamMark

    clock = [0.0]
    source = InMemoryStreamSource(num_partitions=1)
    source.append(0, 10)
    manager = ShardManager(clock=lambda: clock[0])
    manager.register_stream(StreamSpec("s", records_per_shard=10, lease_s=1.0), source)
    (shard,) = manager.fetch_stream_shards("s", "w0", 1).shards
    clock[0] = 2.0
    assert manager.tick() == 1  # w0's lease expired
    assert manager.fetch_stream_shards("s", "w1", 1).shards == (shard.__class__("s", 0, 0, 10, 1),)
    assert not manager.mark_stream("s", "w0", StreamMark(0, 0, 0))  # w0 must skip it
    assert manager.report_stream_done("s", "w0", [(0, 0)]) == 0  # w1's lease stands
    assert manager.stream_progress("s").leased == 1
    assert manager.mark_stream("s", "w1", StreamMark(0, 0, 0))
    assert manager.report_stream_done("s", "w1", [(0, 0)]) == 1
    assert manager.stream_committed("s") == {0: 10}


def test_marks_sent_together_are_recorded_up_to_the_first_range_no_longer_held() -> None:
    from dlrover.sharding.stream import StreamMark

    clock = [0.0]
    source = InMemoryStreamSource(num_partitions=3)
    for partition in range(3):
        source.append(partition, 10)
    manager = ShardManager(clock=lambda: clock[0])
    manager.register_stream(StreamSpec("s", records_per_shard=10, lease_s=1.0), source)
    (x,) = manager.fetch_stream_shards("s", "w0", 1).shards  # partition 0, until 1.0
    clock[0] = 0.8
    y, z = manager.fetch_stream_shards("s", "w0", 2).shards  # partitions 1 and 2, until 1.8
    clock[0] = 1.5
    assert manager.tick() == 1  # w0 stalled past x's lease: x goes to w1
    assert manager.fetch_stream_shards("s", "w1", 1).shards[0].partition == x.partition
    # w0 read y, x, z and marks them in one call: y is recorded, x refused, z not looked at.
    marks = [StreamMark(i * 10, s.partition, s.start) for i, s in enumerate((y, x, z))]
    assert manager.mark_stream_ranges("s", "w0", marks) == 1
    # w0 skips x and marks z again, its begin no longer counting x's records.
    assert manager.mark_stream_ranges("s", "w0", [StreamMark(10, z.partition, z.start)]) == 1
    assert manager.mark_stream("s", "w1", StreamMark(0, x.partition, x.start))
    # When each had yielded 10 records, w0 had trained y (not z), w1 x.
    position = manager.stream_position_at("s", 10).position
    assert position is not None
    assert dict(position.offsets) == {x.partition: 10, y.partition: 10, z.partition: 0}
    assert manager.mark_stream_ranges("s", "w0", []) == 0


class _OlderMaster:
    """The stream calls of a master of an earlier release: no MarkStreamRanges."""

    def __init__(self, manager: ShardManager) -> None:
        self.manager = manager
        self.batched_calls = 0

    def mark_stream(self, stream: str, worker_id: str, mark: object) -> bool:
        return self.manager.mark_stream(stream, worker_id, mark)  # type: ignore[arg-type]

    def mark_stream_ranges(self, stream: str, worker_id: str, marks: object) -> int:
        from dlrover.api.errors import UnsupportedCallError

        self.batched_calls += 1
        raise UnsupportedCallError("the master does not know this call (Method not found!)")


def test_marks_go_one_per_call_to_a_master_that_does_not_know_the_batched_call() -> None:
    from dlrover.client.stream_client import StreamShardingClient
    from dlrover.sharding.stream import StreamMark

    clock = [0.0]
    source = InMemoryStreamSource(num_partitions=2)
    source.append(0, 10)
    source.append(1, 10)
    manager = ShardManager(clock=lambda: clock[0])
    spec = StreamSpec("s", records_per_shard=10, lease_s=1.0)
    manager.register_stream(spec, source)
    (x,) = manager.fetch_stream_shards("s", "w0", 1).shards
    clock[0] = 0.8
    (y,) = manager.fetch_stream_shards("s", "w0", 1).shards
    clock[0] = 1.5
    assert manager.tick() == 1  # x's lease ran out
    master = _OlderMaster(manager)
    client = StreamShardingClient(master, spec, "w0")  # type: ignore[arg-type]
    marks = [StreamMark(0, y.partition, y.start), StreamMark(10, x.partition, x.start)]
    assert client.send_marks(marks) == 1  # y recorded, x refused: the same answer as batched
    assert client.send_marks([StreamMark(10, 1, 10)]) == 0  # not y's range: refused
    assert master.batched_calls == 1  # asked once, then one mark per call


def test_a_range_leased_again_to_the_same_worker_is_refused_under_its_old_lease() -> None:
    """The worker stalled past its lease and asked for more: the master gave it the same range
    again (a new attempt). Its mark of the copy it read under the old lease is refused, so it
    yields the range once, not twice."""
    from dlrover.sharding.stream import StreamMark

    clock = [0.0]
    source = InMemoryStreamSource(num_partitions=1)
    source.append(0, 10)
    manager = ShardManager(clock=lambda: clock[0])
    manager.register_stream(StreamSpec("s", records_per_shard=10, lease_s=1.0), source)
    (old,) = manager.fetch_stream_shards("s", "w0", 1).shards
    clock[0] = 2.0
    assert manager.tick() == 1
    (new,) = manager.fetch_stream_shards("s", "w0", 1).shards
    assert (new.partition, new.start) == (old.partition, old.start)
    assert new.attempt == old.attempt + 1
    stale = StreamMark(0, old.partition, old.start, attempt=old.attempt)
    assert not manager.mark_stream("s", "w0", stale)
    assert manager.mark_stream("s", "w0", StreamMark(0, new.partition, new.start, attempt=1))
    # A mark that names no attempt (a client of an earlier release) is not checked.
    assert manager.mark_stream("s", "w0", StreamMark(0, new.partition, new.start))


def test_growing_ranges_double_up_to_their_cap_and_a_bounded_tail_stays_small() -> None:
    """max_records_per_shard: a partition's ranges double from records_per_shard up to it
    (fewer calls per record on a long stream), each at most half of what there is to cut (the
    tail of a bounded partition, a live one's backlog); a range cut short does not grow."""
    source = InMemoryStreamSource(num_partitions=2)
    source.append(0, 1000)
    source.append(1, 3)  # a live partition with few records yet
    manager = ShardManager(clock=lambda: 0.0)
    spec = StreamSpec("s", records_per_shard=4, max_records_per_shard=32, lease_s=10.0)
    manager.register_stream(spec, source)
    sizes: dict[int, list[int]] = {0: [], 1: []}
    while shards := manager.fetch_stream_shards("s", "w", 1).shards:
        sizes[shards[0].partition].append(shards[0].end - shards[0].start)
    assert sizes[0][:5] == [4, 8, 16, 32, 32] and sum(sizes[0]) == 1000
    assert sizes[1] == [3]
    source.append(1, 20)  # more came: the first size again, then grown, then half the rest
    while shards := manager.fetch_stream_shards("s", "w", 1).shards:
        sizes[shards[0].partition].append(shards[0].end - shards[0].start)
    assert sizes[1] == [3, 4, 8, 4, 4]

    bounded = InMemoryStreamSource(num_partitions=1)
    bounded.append(0, 200)
    manager = ShardManager(clock=lambda: 0.0)
    spec = StreamSpec("b", 4, max_records_per_shard=64, end_offsets=((0, 200),))
    manager.register_stream(spec, bounded)
    cut = []
    while shards := manager.fetch_stream_shards("b", "w", 1).shards:
        cut.append((shards[0].start, shards[0].end))
    assert [e - s for s, e in cut][:4] == [4, 8, 16, 32] and cut[-1][1] == 200
    assert all(e - s <= max(4, (200 - s) // 2) for s, e in cut)  # the tail shrinks


def test_a_cap_under_the_first_range_is_refused() -> None:
    with pytest.raises(InvalidSpecError, match="max_records_per_shard"):
        StreamSpec("s", records_per_shard=100, max_records_per_shard=10)
