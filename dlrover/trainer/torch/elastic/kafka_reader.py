"""Reads offset ranges of a Kafka topic with one consumer that stays assigned between ranges."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from dlrover.sharding.errors import StreamSourceError
from dlrover.sharding.stream import StreamShard

CONSUME_BATCH = 500
"""Records asked of the client at once. Up to ~500 the client answers from what it fetched
already; asking for more makes it wait for further fetches (about 20 ms each here)."""


class RangeReader:
    """The records of offset ranges of ``topic``, read by one ``confluent_kafka.Consumer``.

    Re-positioning a consumer (``assign``/``seek``) costs a fetch round trip before the first
    record (7-15 ms against a local broker, more than reading 1024 records takes), so a
    partition stays assigned once read, and the next range of it that starts where the last
    one ended (or a little further: the records between are read and dropped) goes on from
    there. Records of other partitions that arrive meanwhile are kept for their next range;
    a partition with more than ``buffer_limit`` records or about ``buffer_bytes`` of values
    kept is paused until a range of it is leased next (``prepare``) or read.
    Only a range elsewhere (given back by another rank, a restored position) re-positions.

    Invariant, per assigned partition: every record the consumer delivered at or after
    ``_cursor[p]`` is in ``_kept[p]`` (in offset order), or is still to come from the consumer.
    """

    def __init__(
        self,
        consumer: Any,
        topic: str,
        bootstrap: str,
        skip_limit: int,
        buffer_limit: int,
        buffer_bytes: int | None = None,
    ) -> None:
        self._consumer = consumer
        self._topic = topic
        self._bootstrap = bootstrap
        self._skip_limit = skip_limit
        self._buffer_limit = buffer_limit
        self._buffer_bytes = buffer_bytes
        self._cursor: dict[int, int | None] = {}
        self._kept: dict[int, deque[Any]] = {}
        self._paused: set[int] = set()
        self._next: set[int] = set()
        """Partitions of the ranges leased next: never paused, their records are read soon."""

    def close(self) -> None:
        """Close the consumer."""
        self._consumer.close()

    def read(
        self,
        shard: StreamShard,
        stopped: Callable[[], bool],
        read_timeout_s: float,
        poll_s: float,
        keep_alive: Callable[[], None],
    ) -> list[Any]:
        """The messages of ``shard``'s offset range, in order (fewer if ``stopped()`` turns
        true). Offsets may have gaps (transaction markers, compaction, retention): the range is
        read once the consumer is past its end. Raises StreamSourceError when the broker does
        not deliver them within ``read_timeout_s``."""
        from confluent_kafka import KafkaError

        partition, end = shard.partition, shard.end
        self._position(shard)
        kept = self._kept[partition]
        out: list[Any] = []
        expected = shard.start
        while kept and expected < end:
            message = kept.popleft()
            offset = message.offset()
            if offset >= end:
                kept.appendleft(message)
                expected = end  # a later record: none is left below the end
            elif offset >= expected:
                out.append(message)
                expected = offset + 1
        deadline = time.monotonic() + read_timeout_s
        last_error = ""
        try:
            while expected < end:
                if stopped():
                    self._cursor[partition] = None  # read partly: re-position next time
                    return out
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._cursor[partition] = None
                    raise StreamSourceError(
                        f"the Kafka brokers {self._bootstrap} did not deliver records "
                        f"[{expected}, {end}) of topic {self._topic!r} partition "
                        f"{partition} within {read_timeout_s:.0f}s"
                        f"{f' ({last_error})' if last_error else ''}. Check that they run; the "
                        f"training position is not lost: a restarted worker resumes from its "
                        f"checkpoint."
                    )
                batch = self._consumer.consume(
                    num_messages=CONSUME_BATCH, timeout=min(remaining, poll_s)
                )
                before = expected
                for message in batch:
                    error = message.error()
                    if error is not None:
                        if error.code() != KafkaError._PARTITION_EOF:
                            last_error = str(error)
                        continue
                    other = message.partition()
                    if other != partition:
                        held = self._kept.get(other)
                        if held is not None:  # else: of a partition no longer read here
                            held.append(message)
                        continue
                    offset = message.offset()
                    if offset >= end:
                        kept.append(message)
                        expected = end
                    elif offset >= expected:
                        out.append(message)
                        expected = offset + 1
                if expected > before:  # records came: the broker delivers
                    deadline = time.monotonic() + read_timeout_s
                if expected < end and not kept and self._past(shard):
                    expected = end
                self._pause_full(partition)
                keep_alive()  # a slow broker must not cost the leases
        except BaseException:
            self._cursor[partition] = None
            raise
        self._cursor[partition] = end
        return out

    def prepare(self, shards: list[StreamShard]) -> None:
        """Assign the partitions of ``shards`` (ranges to read next) not assigned yet, at their
        starts, and resume those paused, so that their fetches run while another range is read
        (resumed only when its range is read, a partition cost a fetch round trip then: ~100 ms
        with a local broker)."""
        from confluent_kafka import TopicPartition

        new: dict[int, int] = {}
        for s in shards:  # at the earliest range of each: a later one would re-position it
            if s.partition not in self._kept:
                new[s.partition] = min(s.start, new.get(s.partition, s.start))
        if new:
            self._consumer.incremental_assign(
                [TopicPartition(self._topic, p, start) for p, start in new.items()]
            )
            for partition, start in new.items():
                self._kept[partition] = deque()
                self._cursor[partition] = start
        self._next = {s.partition for s in shards}
        paused = self._next & self._paused
        if paused:
            self._consumer.resume([TopicPartition(self._topic, p) for p in sorted(paused)])
            self._paused -= paused

    def _position(self, shard: StreamShard) -> None:
        """Make the consumer deliver ``shard.partition`` from ``shard.start`` on (or from a
        little before it): assign it the first time, re-position only when the range is not
        where the partition's reading stands."""
        from confluent_kafka import TopicPartition

        partition = shard.partition
        cursor = self._cursor.get(partition, None)
        if partition not in self._kept:
            self._consumer.incremental_assign([TopicPartition(self._topic, partition, shard.start)])
            self._kept[partition] = deque()
            self._cursor[partition] = shard.start
        elif cursor is None or not cursor <= shard.start <= cursor + self._skip_limit:
            topic_partition = TopicPartition(self._topic, partition)
            self._consumer.incremental_unassign([topic_partition])
            self._paused.discard(partition)
            self._consumer.incremental_assign([TopicPartition(self._topic, partition, shard.start)])
            self._kept[partition].clear()
            self._cursor[partition] = shard.start
        if partition in self._paused:
            self._consumer.resume([TopicPartition(self._topic, partition)])
            self._paused.discard(partition)

    def _pause_full(self, reading: int) -> None:
        """Pause the partitions (other than ``reading`` and those read next) holding more than
        the buffer limit: memory stays bounded when this rank reads some partitions rarely.
        The bytes are estimated from the oldest record kept (a partition's records are
        usually alike), not summed per record."""
        from confluent_kafka import TopicPartition

        full = [
            p
            for p, kept in self._kept.items()
            if kept
            and p != reading
            and p not in self._paused
            and p not in self._next
            and (
                len(kept) > self._buffer_limit
                or (
                    self._buffer_bytes is not None and len(kept) * len(kept[0]) > self._buffer_bytes
                )
            )
        ]
        if full:
            self._consumer.pause([TopicPartition(self._topic, p) for p in full])
            self._paused.update(full)

    def _past(self, shard: StreamShard) -> bool:
        """Whether the consumer is past the end of ``shard`` though it delivered no record at or
        after it: the last offsets of the range hold no record (a transaction's marker moves the
        position past it) or were deleted (the oldest offset kept is at or past the end)."""
        from confluent_kafka import KafkaException, TopicPartition

        partition = TopicPartition(self._topic, shard.partition)
        try:
            (position,) = self._consumer.position([partition])
            oldest, _ = self._consumer.get_watermark_offsets(partition, cached=True)
        except KafkaException:
            return False
        return max(position.offset, oldest) >= shard.end
