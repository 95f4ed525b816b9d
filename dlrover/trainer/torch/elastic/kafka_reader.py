"""Reads offset ranges of a Kafka topic with one consumer that stays assigned between ranges."""

from __future__ import annotations

import itertools
import operator
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from typing import Any

from dlrover.sharding.errors import StreamSourceError
from dlrover.sharding.stream import StreamShard

CONSUME_BATCH = 500
"""Records asked of the client at once. Up to ~500 the client answers from what it fetched
already; asking for more makes it wait for further fetches (about 20 ms each here)."""


class Records:
    """Records of one partition in offset order, as columns of plain values: their offsets,
    values and, for a decode that needs them, keys and timestamps (ms). The client's message
    objects are not kept: Python's garbage collector tracks them, and with ~200 k of them held
    (the partitions this reader was not reading at the time) its collections tripled the
    reader's CPU time. Records are decoded only once they are a range's, in order."""

    __slots__ = ("columns",)

    def __init__(self, columns: list[list[Any]]) -> None:
        self.columns = columns

    @classmethod
    def of(cls, messages: list[Any], full: bool) -> Records:
        """The columns of ``messages`` (the client's, of one partition); keys and timestamps
        only if ``full``."""
        columns = [
            [message.offset() for message in messages],
            [message.value() for message in messages],
        ]
        if full:
            columns.append([message.key() for message in messages])
            columns.append([message.timestamp()[1] for message in messages])
        return cls(columns)

    def empty(self) -> Records:
        """No records, with the same columns."""
        return Records([[] for _ in self.columns])

    @property
    def offsets(self) -> list[int]:
        """The records' offsets."""
        return self.columns[0]

    @property
    def values(self) -> list[bytes | None]:
        """The records' values."""
        return self.columns[1]

    def rows(self) -> Any:
        """(offset, value, key, timestamp) of each record (a ``full`` one)."""
        return zip(*self.columns, strict=True)

    def __len__(self) -> int:
        return len(self.columns[0])

    def split(self, expected: int, end: int, out: Records) -> tuple[int, Records | None]:
        """Append the records of offsets [expected, end) to ``out``, drop those below
        ``expected``; returns the next offset expected and the records at or after ``end``
        (then the next offset expected is ``end``)."""
        offsets = self.offsets
        if all(map(operator.lt, offsets, itertools.islice(offsets, 1, None))):  # the usual case
            low = bisect_left(offsets, expected)
            high = bisect_left(offsets, end, low)
            if high > low:
                for column, into in zip(self.columns, out.columns, strict=True):
                    into += column[low:high]
                expected = offsets[high - 1] + 1
            if high < len(offsets):
                return end, Records([column[high:] for column in self.columns])
            return expected, None
        rest = self.empty()
        for row in zip(*self.columns, strict=True):
            offset = row[0]
            if offset >= end:
                target = rest
                expected = end
            elif offset >= expected:
                target = out
                expected = offset + 1
            else:
                continue
            for column, value in zip(target.columns, row, strict=True):
                column.append(value)
        return expected, rest if len(rest) else None


class _Kept:
    """The records of one partition delivered before its range was read: runs in offset order
    as the consumer delivered them, how many records they hold, and the size of a record's
    value when they arrived (a partition's records are usually alike: not summed per record)."""

    __slots__ = ("count", "record_bytes", "runs")

    def __init__(self) -> None:
        self.runs: deque[Records] = deque()
        self.count = 0
        self.record_bytes = 0

    def __bool__(self) -> bool:
        return self.count > 0

    def add(self, run: Records, record_bytes: int) -> None:
        self.runs.append(run)
        self.count += len(run)
        self.record_bytes = record_bytes

    def clear(self) -> None:
        self.runs.clear()
        self.count = 0

    def take(self, expected: int, end: int, out: Records) -> int:
        """Move the kept records of offsets [expected, end) to ``out``, drop those below
        ``expected``; returns the next offset expected (``end`` once a later one is kept)."""
        while self.runs and expected < end:
            run = self.runs.popleft()
            self.count -= len(run)
            expected, rest = run.split(expected, end, out)
            if rest is not None:
                self.runs.appendleft(rest)
                self.count += len(rest)
        return expected


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

    What is kept is columns of plain values (`Records`), not the client's message objects.

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
        full: bool = False,
    ) -> None:
        self._consumer = consumer
        self._topic = topic
        self._bootstrap = bootstrap
        self._skip_limit = skip_limit
        self._buffer_limit = buffer_limit
        self._buffer_bytes = buffer_bytes
        self._full = full
        """Keep the records' keys and timestamps too (a decode that needs whole records)."""
        self._cursor: dict[int, int | None] = {}
        self._kept: dict[int, _Kept] = {}
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
    ) -> Records:
        """The records of ``shard``'s offset range, in order (fewer if ``stopped()`` turns
        true). Offsets may have gaps (transaction markers, compaction, retention): the range is
        read once the consumer is past its end. Raises StreamSourceError when the broker does
        not deliver them within ``read_timeout_s``."""
        from confluent_kafka import KafkaError

        partition, end = shard.partition, shard.end
        self._position(shard)
        kept = self._kept[partition]
        out = Records([[] for _ in range(4 if self._full else 2)])
        expected = kept.take(shard.start, end, out)
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
                if any([message.error() for message in batch]):
                    good = []
                    for message in batch:
                        error = message.error()
                        if error is None:
                            good.append(message)
                        elif error.code() != KafkaError._PARTITION_EOF:
                            last_error = str(error)
                    batch = good
                for other, run in self._runs(batch):
                    held = kept if other == partition else self._kept.get(other)
                    if held is None:
                        continue  # of a partition no longer read here
                    records = Records.of(run, self._full)
                    if held is kept:
                        expected, rest = records.split(expected, end, out)
                        if rest is None:
                            continue
                        records = rest
                    held.add(records, len(run[0]))  # a message's len: its value's
                if expected > before:  # records came: the broker delivers
                    deadline = time.monotonic() + read_timeout_s
                if expected < end and not kept and self._past(shard):
                    expected = end
                self._pause_full(partition)
                keep_alive()  # a slow broker must not cost the leases
        except BaseException:
            # A batch the client handed over may be stored in part: re-position every
            # partition at its next read rather than miss a record.
            for held in self._kept.values():
                held.clear()
            self._cursor = dict.fromkeys(self._cursor)
            raise
        self._cursor[partition] = end
        return out

    @staticmethod
    def _runs(batch: list[Any]) -> list[tuple[int, list[Any]]]:
        """``batch`` as runs of one partition each, in order (usually a single run: the client
        delivers a fetch's records of a partition together)."""
        if not batch:
            return []
        partitions = [message.partition() for message in batch]
        first = partitions[0]
        if partitions.count(first) == len(partitions):
            return [(first, batch)]
        runs: list[tuple[int, list[Any]]] = []
        index = 0
        for key, group in itertools.groupby(partitions):
            size = sum(1 for _ in group)
            runs.append((key, batch[index : index + size]))
            index += size
        return runs

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
                self._kept[partition] = _Kept()
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
            self._kept[partition] = _Kept()
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
                kept.count > self._buffer_limit
                or (
                    self._buffer_bytes is not None
                    and kept.count * kept.record_bytes > self._buffer_bytes
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
