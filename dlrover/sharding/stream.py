"""Shards of an unbounded source, split by (partition, offset range), with leases like datasets."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from dlrover.sharding.config import DEFAULT_LEASE_S, DEFAULT_MAX_RETRIES
from dlrover.sharding.errors import (
    InvalidPositionError,
    InvalidSpecError,
    ShardRetriesExhaustedError,
)
from dlrover.sharding.leases import Lease, LeaseTable
from dlrover.sharding.ledger import Ledgers
from dlrover.sharding.types import DeliveryMode

logger = logging.getLogger(__name__)


class StreamSource(Protocol):
    """What the master needs to know of a stream: its partitions and how far each has grown."""

    def partitions(self) -> Sequence[int]:
        """The partition numbers; a StreamQueue reads them once, when it is created."""
        ...

    def start_offset(self, partition: int) -> int:
        """Where a new stream starts reading ``partition`` (a checkpoint's position overrides)."""
        ...

    def end_offset(self, partition: int) -> int:
        """One past the last record currently available in `partition`."""
        ...


class InMemoryStreamSource:
    """A stream whose partitions grow when `append` is called: for tests and benchmarks."""

    def __init__(self, num_partitions: int) -> None:
        self._ends = [0] * num_partitions

    def partitions(self) -> Sequence[int]:
        """Partitions 0 .. num_partitions - 1."""
        return range(len(self._ends))

    def start_offset(self, partition: int) -> int:
        """Every partition starts at offset 0."""
        return 0

    def end_offset(self, partition: int) -> int:
        """One past the last record appended to ``partition``."""
        return self._ends[partition]

    def append(self, partition: int, count: int) -> None:
        """Make ``count`` more records available in ``partition``."""
        self._ends[partition] += count


class BoundedStreamSource:
    """A source whose records are all known when it is registered: partition ``p`` holds
    offsets 0 .. ``end_offsets[p]`` (a materialized Ray Data dataset: one partition of its
    rows). The master needs nothing else of it; the workers read the records themselves."""

    def __init__(self, end_offsets: Sequence[tuple[int, int]]) -> None:
        self._ends = dict(end_offsets)

    def partitions(self) -> Sequence[int]:
        """The partitions the end offsets name."""
        return sorted(self._ends)

    def start_offset(self, partition: int) -> int:
        """Every partition starts at 0."""
        return 0

    def end_offset(self, partition: int) -> int:
        """The end offset given at registration."""
        return self._ends[partition]


@dataclass(frozen=True)
class StreamSpec:
    """A registered stream: records per shard, retries and lease time, as for datasets.

    ``topic`` and ``bootstrap_servers`` name a Kafka topic for the master to read (a stream
    registered over the wire needs them; in-process tests pass a source instead). Offsets the
    workers finished are committed to the broker under ``group_id`` (default
    ``dlrover-<name>``), so Kafka's own tools show the lag. ``end_offsets`` is the end policy:
    (partition, offset) pairs where the stream ends; empty means unbounded (it ends on
    ``stop``). ``mode``: AT_MOST_ONCE drops a lost worker's ranges instead of handing them out
    again and does not go back to a checkpoint's position (see StreamQueue); the other two
    modes are the same on the master (exactly once needs the checkpoint's position restored).
    ``max_records_per_shard`` > 0 lets a partition's ranges grow: the first is
    ``records_per_shard`` records, each next one twice the last, up to this many, but never
    more than half of the records there are to cut (the last ranges of a bounded partition, or
    of a live one's backlog, stay small, so the ranks finish together); 0 cuts every range at
    ``records_per_shard``.
    """

    name: str
    records_per_shard: int
    max_retries: int = DEFAULT_MAX_RETRIES
    lease_s: float = DEFAULT_LEASE_S
    topic: str = ""
    bootstrap_servers: str = ""
    group_id: str = ""
    end_offsets: tuple[tuple[int, int], ...] = ()
    mode: DeliveryMode = DeliveryMode.EXACTLY_ONCE
    max_records_per_shard: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", DeliveryMode(self.mode))
        if not self.name or self.records_per_shard < 1 or self.max_retries < 0 or self.lease_s <= 0:
            raise InvalidSpecError(
                f"stream {self.name!r}: needs a name, records_per_shard >= 1, max_retries >= 0 "
                f"and lease_s > 0 (got {self.records_per_shard}, {self.max_retries}, "
                f"{self.lease_s})"
            )
        if self.max_records_per_shard and self.max_records_per_shard < self.records_per_shard:
            raise InvalidSpecError(
                f"stream {self.name!r}: max_records_per_shard ({self.max_records_per_shard}) is "
                f"under records_per_shard ({self.records_per_shard}); 0 keeps ranges at "
                "records_per_shard"
            )
        # A spec read back from JSON has lists; keep the frozen, comparable form.
        ends = tuple(sorted((int(p), int(o)) for p, o in self.end_offsets))
        if any(o < 0 for _, o in ends) or len({p for p, _ in ends}) != len(ends):
            raise InvalidSpecError(
                f"stream {self.name!r}: end_offsets needs one offset >= 0 per partition, got "
                f"{list(self.end_offsets)}"
            )
        object.__setattr__(self, "end_offsets", ends)
        if bool(self.topic) != bool(self.bootstrap_servers):
            raise InvalidSpecError(
                f"stream {self.name!r}: a Kafka stream needs both topic and bootstrap_servers"
            )

    @property
    def commit_group(self) -> str:
        """The consumer group the stream's finished offsets are committed under."""
        return self.group_id or f"dlrover-{self.name}"


@dataclass(frozen=True)
class StreamPosition:
    """What of a stream has been trained: save it with the model, restore it after a failure.

    Per partition, every record below its offset in ``offsets`` was trained, except the ranges
    in ``pending`` as (partition, start, end): those were not. Records at or above the offset
    were not read yet.
    """

    stream: str
    offsets: tuple[tuple[int, int], ...]
    pending: tuple[tuple[int, int, int], ...] = ()

    def committed(self) -> dict[int, int]:
        """Per partition, the first record not trained (what a Kafka consumer commits)."""
        low = dict(self.offsets)
        for partition, start, _ in self.pending:
            low[partition] = min(low[partition], start)
        return low

    def to_dict(self) -> dict[str, Any]:
        """The JSON form a checkpoint keeps."""
        return {
            "stream": self.stream,
            "offsets": [list(entry) for entry in self.offsets],
            "pending": [list(entry) for entry in self.pending],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StreamPosition:
        """Rebuild from ``to_dict()``; a missing stream or offsets raises KeyError."""
        return cls(
            str(data["stream"]),
            tuple((int(p), int(o)) for p, o in data["offsets"]),
            tuple((int(p), int(s), int(e)) for p, s, e in data.get("pending", [])),
        )


@dataclass(frozen=True)
class StreamMark:
    """Where a worker stands in its pass over a stream: it is about to yield the ``count``
    records of the shard starting at ``start`` in ``partition``, and they occupy [begin,
    begin + count) of the records it yields in this pass. ``count`` None: the shard's length
    (fewer where the partition's offsets have gaps). Without a partition: the pass ended after
    ``begin``."""

    begin: int
    partition: int | None = None
    start: int = 0
    count: int | None = None
    attempt: int | None = None
    """The lease's attempt the worker read the shard under (None: not checked): a shard that
    went back to the queue and was leased to the same worker again is refused under the old
    one, so the worker does not yield both copies."""


@dataclass(frozen=True)
class StreamPositionAt:
    """Answer to position_at: the position, or the workers whose marks do not reach the asked
    record count yet (ask again shortly)."""

    position: StreamPosition | None
    waiting_for: tuple[str, ...] = ()


@dataclass(frozen=True)
class StreamFetchResult:
    """Leased shards; none and ``finished`` means the stream has ended and nothing is left for this
    worker (what remains is leased to others), none and not finished that no new records are
    available now (ask again)."""

    shards: tuple[StreamShard, ...]
    finished: bool = False


@dataclass(frozen=True)
class StreamProgress:
    """A stream's counters: per partition how far it is done and how far the source has grown;
    ``finished`` once it has ended and every range is done."""

    stream: str
    committed: tuple[tuple[int, int], ...]
    end_offsets: tuple[tuple[int, int], ...]
    leased: int
    stopped: bool
    finished: bool
    lost_records: int = 0
    """At-most-once: records handed out that the job's model never trained and that are never
    handed out again (see StreamQueue)."""

    @property
    def lag(self) -> int:
        """Records available but not yet done, over every partition."""
        ends = dict(self.end_offsets)
        return sum(max(0, ends.get(p, o) - o) for p, o in self.committed)


@dataclass(frozen=True)
class StreamShard:
    """A lease on records [start, end) of one partition of a stream."""

    stream: str
    partition: int
    start: int
    end: int
    attempt: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The shard's fields as a plain dict."""
        return asdict(self)


# (partition, start) identifies a stream shard; (partition, start, end, attempt) a requeued one.
_StreamKey = tuple[int, int]
# A mark names its shard with the end too: a range of records, finished or not, outlives its
# lease in the marks.
_MarkKey = tuple[int, int, int]

_MARKS_KEPT = 1024
"""Marks of finished shards kept per worker: far more than a worker reads ahead of a checkpoint."""


class StreamQueue:
    """Leases offset ranges of a stream's partitions; lost ones go back to the queue head.

    At most once, lost ranges are dropped instead and counted (``lost_records``), and a
    restore does not go back to the checkpoint's position: it counts as lost every record the
    checkpoint had not trained that was handed out since (the restored model never trains it),
    drops the leases, and the stream goes on from where it is. ``lost_records`` is then exactly
    the records the job's model never trained.

    The committed position of a partition is the lowest offset not known to be done: the
    smaller of its read cursor and the start of its earliest shard in flight or requeued.
    Workers mark each shard before they yield its records (StreamMark), so ``position_at``
    can say what was trained when every worker had yielded a given number of records: the
    exactly-once position a checkpoint keeps.
    """

    def __init__(
        self, spec: StreamSpec, source: StreamSource, next_offset: dict[int, int] | None = None
    ) -> None:
        self.spec = spec
        self.source = source
        self.next_offset: dict[int, int] = (
            dict(next_offset)
            if next_offset is not None
            else {p: source.start_offset(p) for p in source.partitions()}
        )
        self.requeued: deque[tuple[int, int, int, int]] = deque()
        self._range_size = dict.fromkeys(self.next_offset, spec.records_per_shard)
        """The next range's size of each partition (growing: see StreamSpec)."""
        self.leases: LeaseTable[_StreamKey] = LeaseTable()
        self.ends: dict[_StreamKey, int] = {}
        self.ledgers: Ledgers[_MarkKey] = Ledgers()
        self.failure: str | None = None
        self.stopped = False
        self.restore_token: str | None = None
        self.lost_records = 0
        """At-most-once: records handed out that the job's model never trained."""
        self.dropped: list[tuple[int, int, int]] = []
        """At-most-once: the ranges dropped since the last restore (counted in lost_records)."""
        self._next_partition = 0
        named = {p for p, _ in spec.end_offsets}
        if named and named != set(self.next_offset):
            raise InvalidSpecError(
                f"stream {spec.name!r}: end_offsets name partitions {sorted(named)}, the source "
                f"has {sorted(self.next_offset)}; give an end offset for each"
            )

    def fetch(self, worker_id: str, max_count: int, now: float) -> StreamFetchResult:
        """Lease up to ``max_count`` record ranges to ``worker_id`` until ``now + lease_s``:
        requeued ranges first, then new ones (``records_per_shard`` records, or growing: see
        StreamSpec), cut round-robin over the partitions; fewer when no new records are
        available. Raises ShardRetriesExhaustedError once a range was lost more than
        ``max_retries`` times."""
        if self.failure is not None:
            raise ShardRetriesExhaustedError(self.failure)
        shards: list[StreamShard] = []
        while len(shards) < max_count:
            entry = self.requeued.popleft() if self.requeued else self._cut_new()
            if entry is None:
                break
            partition, start, end, attempt = entry
            self.leases.grant(
                (partition, start), Lease(worker_id, now + self.spec.lease_s, attempt)
            )
            self.ends[(partition, start)] = end
            shards.append(StreamShard(self.spec.name, partition, start, end, attempt))
        return StreamFetchResult(tuple(shards), finished=not shards and self.finished())

    def _limit(self, partition: int) -> int | None:
        return dict(self.spec.end_offsets).get(partition)

    def _cut_new(self) -> tuple[int, int, int, int] | None:
        if self.stopped:
            return None
        # Round-robin over partitions so one busy partition does not starve the others.
        partitions = list(self.next_offset)
        for step in range(len(partitions)):
            partition = partitions[(self._next_partition + step) % len(partitions)]
            start = self.next_offset[partition]
            available = self.source.end_offset(partition)
            limit = self._limit(partition)
            if limit is not None:
                available = min(available, limit)
            # A grown range takes at most half of what is there: the last ranges of a bounded
            # partition, or of a live one's backlog, stay small, so the ranks finish together.
            size = min(
                self._range_size.get(partition, self.spec.records_per_shard),
                max(self.spec.records_per_shard, (available - start) // 2),
            )
            end = min(start + size, available)
            if end > start:
                if self.spec.max_records_per_shard and end - start == size:
                    grown = min(2 * size, self.spec.max_records_per_shard)
                    self._range_size[partition] = max(grown, self._range_size.get(partition, 0))
                self.next_offset[partition] = end
                self._next_partition = (self._next_partition + step + 1) % len(partitions)
                return (partition, start, end, 0)
        return None

    def finished(self) -> bool:
        """Nothing more to hand out, ever: stopped, or every partition cut up to its end offset,
        and nothing requeued. Ranges still leased to others do not count: a worker in a
        lockstep job must not wait for a range another worker is about to read (that worker
        waits for it at the next collective)."""
        if self.requeued:
            return False
        if self.stopped:
            return True
        if not self.spec.end_offsets:
            return False
        return all(self.next_offset[p] >= offset for p, offset in self.spec.end_offsets)

    def stop(self) -> None:
        """Cut no new shards: the stream ends for each worker once it has read its ranges."""
        self.stopped = True

    def report_done(self, worker_id: str, shards: Sequence[tuple[int, int]]) -> int:
        """Mark ranges, named by (partition, start), as done: those ``worker_id`` holds, and those
        back in the queue (a worker whose lease expired had trained them; read again they
        would be trained twice). A range leased to another worker stays its: a former holder's
        report must not end the new holder's lease. Returns how many counted."""
        accepted = 0
        for key in shards:
            lease = self.leases.get(key)
            if lease is not None:
                if lease.worker_id != worker_id:
                    logger.warning(
                        "stream %r: %s reported %s done, which is leased to %s now: ignored",
                        self.spec.name,
                        worker_id,
                        key,
                        lease.worker_id,
                    )
                    continue
                self.leases.release(key)
                self.ends.pop(key, None)
                accepted += 1
            else:
                before = len(self.requeued)
                self.requeued = deque(e for e in self.requeued if (e[0], e[1]) != key)
                accepted += before - len(self.requeued)
        return accepted

    def give_back(self, worker_id: str, remainders: Sequence[tuple[int, int, int, int]]) -> int:
        """Take back ranges ``worker_id`` will not read further (its pass was closed early). Each
        (partition, start, resume, yielded) names a range it holds, the first offset of it it did
        not yield and how many records it yielded: [start, resume) counts as read, [resume, end)
        goes to the head of the queue (no retry spent), and the worker's mark is cut to what it
        yielded. Ranges it does not hold are ignored; returns how many were taken back."""
        back = []
        for partition, start, resume, yielded in remainders:
            key = (partition, start)
            lease = self.leases.get(key)
            if lease is None or lease.worker_id != worker_id:
                continue
            end = self.ends[key]
            if not start <= resume <= end or not 0 <= yielded <= resume - start:
                raise InvalidSpecError(
                    f"stream {self.spec.name!r}: cannot give back {partition}:[{start}, {end}) "
                    f"at {resume} after {yielded} records"
                )
            self.leases.release(key)
            del self.ends[key]
            self.ledgers.cut(
                worker_id, (partition, start, end), (partition, start, resume), yielded
            )
            back.append((partition, resume, end, lease.attempt))
        self.requeued.extendleft(reversed([entry for entry in back if entry[1] < entry[2]]))
        return len(back)

    def renew(self, worker_id: str, now: float) -> int:
        """Extend every lease ``worker_id`` holds to ``now + lease_s``; returns how many."""
        return self.leases.renew(worker_id, now + self.spec.lease_s)

    def mark(self, worker_id: str, mark: StreamMark) -> bool:
        """Record where ``worker_id`` stands in its pass (see StreamMark). A mark of a shard the
        worker no longer holds (its lease expired) is refused (False): that shard went back to
        the queue, and the worker must not yield it."""
        if mark.begin < 0:
            raise InvalidSpecError(f"mark of stream {self.spec.name!r}: negative begin {mark}")
        if mark.partition is None:
            self.ledgers.record(worker_id, 0, mark.begin, None, 0, 0)
            return True
        key = (mark.partition, mark.start)
        lease = self.leases.get(key)
        if (
            lease is None
            or lease.worker_id != worker_id
            or (mark.attempt is not None and mark.attempt != lease.attempt)
        ):
            logger.warning(
                "stream %r: refused %s of %s (not its lease: it expired)",
                self.spec.name,
                mark,
                worker_id,
            )
            return False
        end = self.ends[key]
        count = end - mark.start if mark.count is None else mark.count
        if not 0 <= count <= end - mark.start:
            raise InvalidSpecError(
                f"mark of stream {self.spec.name!r}: {count} records in [{mark.start}, {end})"
            )
        self.ledgers.record(worker_id, 0, mark.begin, (*key, end), 0, count)
        # A stream's pass never ends: forget finished shards far behind, or marks grow forever.
        self.ledgers.trim(worker_id, _MARKS_KEPT, self._is_open)
        return True

    def mark_all(self, worker_id: str, marks: Sequence[StreamMark]) -> int:
        """``mark`` each of ``marks`` in order up to the first refused; returns how many were
        recorded (the later ones counted the refused range in their begins)."""
        for index, mark in enumerate(marks):
            if not self.mark(worker_id, mark):
                return index
        return len(marks)

    def _is_open(self, key: _MarkKey) -> bool:
        partition, start, _ = key
        return self.leases.get((partition, start)) is not None or any(
            (p, s) == (partition, start) for p, s, _, _ in self.requeued
        )

    def recover_worker(self, worker_id: str) -> list[_StreamKey]:
        """Put every range ``worker_id`` holds back at the head of the queue; returns their keys.
        Its marks of those ranges go (they are read again whole: at least once); those of the
        ranges it finished stay, so a position at an earlier step still counts the ones it
        finished after that step as not trained."""
        back = self._requeue(sorted(self.leases.held_by(worker_id)), f"worker {worker_id} lost")
        self.ledgers.forget_shards(set(back))
        self.ledgers.end(worker_id)
        return [(p, s) for p, s, _ in back]

    def expire(self, now: float) -> list[_StreamKey]:
        """Requeue every range whose lease deadline is at or before ``now``; returns their keys."""
        back = self._requeue(sorted(self.leases.expired(now)), "lease expired")
        self.ledgers.forget_shards(set(back))
        return [(p, s) for p, s, _ in back]

    def _requeue(self, keys: list[_StreamKey], reason: str) -> list[_MarkKey]:
        if self.spec.mode is DeliveryMode.AT_MOST_ONCE:
            return self._drop(keys, reason)
        back = []
        for key in keys:
            lease = self.leases.release(key)
            if lease is None:
                continue
            end = self.ends.pop(key)
            attempt = lease.attempt + 1
            if attempt > self.spec.max_retries and self.failure is None:
                self.failure = (
                    f"stream {self.spec.name!r}: partition {key[0]} records [{key[1]}, {end}) "
                    f"were lost {attempt} times (last: {reason}, worker {lease.worker_id!r}); "
                    f"max_retries={self.spec.max_retries}"
                )
            back.append((key[0], key[1], end, attempt))
        self.requeued.extendleft(reversed(back))
        return [(p, s, e) for p, s, e, _ in back]

    def _drop(self, keys: list[_StreamKey], reason: str) -> list[_MarkKey]:
        """At-most-once: release these leases for good and count their records lost (the
        worker's model is gone with it; a later restore recounts what the checkpoint had)."""
        dropped: list[_MarkKey] = []
        for key in keys:
            lease = self.leases.release(key)
            if lease is None:
                continue
            end = self.ends.pop(key)
            self.lost_records += end - key[1]
            dropped.append((key[0], key[1], end))
            logger.warning(
                "stream %r (at-most-once): records %d:[%d, %d) lost (%s, worker %s); %d lost so "
                "far",
                self.spec.name,
                key[0],
                key[1],
                end,
                reason,
                lease.worker_id,
                self.lost_records,
            )
        self.dropped += dropped
        return dropped

    def committed(self) -> dict[int, int]:
        """Per partition, the offset below which every record is done."""
        low = dict(self.next_offset)
        in_flight = [(p, s) for p, s, _, _ in self.requeued] + [k for k, _ in self.leases.items()]
        for partition, start in in_flight:
            low[partition] = min(low[partition], start)
        return low

    # --- position (checkpoint / restore) --------------------------------------------------
    def position_at(self, consumed: int) -> StreamPositionAt:
        """The position when every worker had yielded ``consumed`` records in its current pass (a
        checkpoint at that step), from the workers' marks: shards they finished since are not
        done in it, the rest of the one each was reading is pending."""
        if consumed < 0:
            raise InvalidSpecError(f"position of stream {self.spec.name!r} at {consumed} records")
        marked, waiting = self.ledgers.at(0, consumed)
        if waiting:
            return StreamPositionAt(None, tuple(waiting))
        pending = {(p, s): (s, e) for p, s, e, _ in self.requeued}
        pending.update({key: (key[1], self.ends[key]) for key, _ in self.leases.items()})
        for (partition, start, end), (used, count) in marked.items():
            if used >= count:
                pending.pop((partition, start), None)
            else:
                # With gaps in the offsets, start + used is at or below the next record: a
                # restore may train again a few records of this range, never skip one.
                pending[(partition, start)] = (start + used, end)
        # Checkpoints move forward: shards done before this one are not asked about again.
        self.ledgers.prune(consumed, self._is_open)
        return StreamPositionAt(self._canonical(pending))

    def _canonical(self, pending: dict[_StreamKey, tuple[int, int]]) -> StreamPosition:
        """Merge touching pending ranges and pull each read cursor back over a pending range that
        ends at it, so equal training gives equal positions whatever was prefetched."""
        offsets = dict(self.next_offset)
        ranges: list[tuple[int, int, int]] = []
        for partition, start, end in sorted((p, s, e) for (p, _), (s, e) in pending.items()):
            if ranges and ranges[-1][0] == partition and ranges[-1][2] == start:
                ranges[-1] = (partition, ranges[-1][1], end)
            else:
                ranges.append((partition, start, end))
        kept = []
        for partition, start, end in reversed(ranges):
            if end == offsets[partition]:
                offsets[partition] = start
            else:
                kept.append((partition, start, end))
        return StreamPosition(self.spec.name, tuple(sorted(offsets.items())), tuple(sorted(kept)))

    def restore(self, position: StreamPosition, token: str | None) -> bool:
        """Restart reading at ``position``: its pending ranges first, then each partition from its
        offset; drops every lease and mark. A repeat of the last applied ``token`` is a no-op."""
        self._check_position(position)
        if token is not None and token == self.restore_token:
            return False
        if self.spec.mode is DeliveryMode.AT_MOST_ONCE:
            self._restore_at_most_once(position, token)
            return True
        self.next_offset.update(dict(position.offsets))
        self.requeued = deque((p, s, e, 0) for p, s, e in sorted(position.pending))
        self.leases.clear()
        self.ends.clear()
        self.ledgers.clear()
        self.failure = None
        self.restore_token = token
        logger.info("stream %r restored to %s", self.spec.name, position)
        return True

    def _restore_at_most_once(self, position: StreamPosition, token: str | None) -> None:
        """Go on from here, not from ``position``: what it had not trained and was handed out
        since is lost (the restored model never trains it), in place of what the drops since
        the last restore counted of it; the leases go (their readers restarted)."""
        untrained = self._untrained_handed_out(position)
        for partition, start, end in self.dropped:
            if _overlap(untrained.get(partition, []), start, end):
                self.lost_records -= end - start
        lost = sum(e - s for spans in untrained.values() for s, e in spans)
        self.lost_records += lost
        self.dropped = []
        self.leases.clear()
        self.ends.clear()
        self.ledgers.clear()
        self.failure = None
        self.restore_token = token
        logger.warning(
            "stream %r is at-most-once: not going back to the checkpoint's position; %d records "
            "it had not trained were handed out since and are lost (%d lost so far)",
            self.spec.name,
            lost,
            self.lost_records,
        )

    def _untrained_handed_out(self, position: StreamPosition) -> dict[int, list[tuple[int, int]]]:
        """Per partition, the merged spans of records ``position`` had not trained that were
        handed out since: above its offset and below the read cursor, and its pending ranges,
        less what is back in the queue (never delivered)."""
        spans: dict[int, list[tuple[int, int]]] = {}
        for partition, offset in position.offsets:
            cursor = self.next_offset.get(partition, offset)
            if cursor > offset:
                spans.setdefault(partition, []).append((offset, cursor))
        for partition, start, end in position.pending:
            end = min(end, self.next_offset.get(partition, end))
            if end > start:
                spans.setdefault(partition, []).append((start, end))
        holes: dict[int, list[tuple[int, int]]] = {}
        for partition, start, end, _ in self.requeued:
            holes.setdefault(partition, []).append((start, end))
        return {p: _minus(_merge(v), _merge(holes.get(p, []))) for p, v in spans.items()}

    def _check_position(self, position: StreamPosition) -> None:
        offsets = dict(position.offsets)
        problem = ""
        if position.stream != self.spec.name:
            problem = f"it belongs to stream {position.stream!r}"
        elif set(offsets) != set(self.next_offset):
            problem = (
                f"it has partitions {sorted(offsets)}, the stream has {sorted(self.next_offset)}"
            )
        elif any(o < 0 for o in offsets.values()):
            problem = "it has a negative offset"
        for partition, start, end in position.pending:
            if problem:
                break
            if partition not in offsets or not 0 <= start < end <= offsets[partition]:
                problem = f"pending range {partition}:[{start}, {end}) is not below its offset"
        if problem:
            raise InvalidPositionError(
                f"cannot restore stream {self.spec.name!r}: {problem}. Restore a position taken "
                f"from this stream (same name and topic)."
            )

    def progress(self) -> StreamProgress:
        """Counters for status, metrics and tests (see StreamProgress)."""
        return StreamProgress(
            self.spec.name,
            tuple(sorted(self.committed().items())),
            tuple((p, self.source.end_offset(p)) for p in sorted(self.next_offset)),
            len(self.leases),
            self.stopped,
            self.finished() and not len(self.leases),
            self.lost_records,
        )

    def to_state(self) -> dict[str, Any]:
        """JSON-able state: spec, read cursors, requeued ranges and leases (not the marks)."""
        return {
            "spec": {**asdict(self.spec), "mode": self.spec.mode.value},
            "next_offset": [[p, o] for p, o in self.next_offset.items()],
            "requeued": [list(e) for e in self.requeued],
            "leases": [
                [k[0], k[1], self.ends[k], lease.worker_id, lease.attempt]
                for k, lease in self.leases.items()
            ],
            "failure": self.failure,
            "stopped": self.stopped,
            "restore_token": self.restore_token,
            "lost_records": self.lost_records,
            "dropped": [list(span) for span in self.dropped],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], source: StreamSource, now: float) -> StreamQueue:
        """Rebuild from ``to_state()`` over ``source``; leases restart their full lease time from
        ``now``."""
        offsets = {int(p): int(o) for p, o in state["next_offset"]}
        queue = cls(StreamSpec(**state["spec"]), source, offsets)
        queue.requeued = deque(tuple(int(x) for x in e) for e in state["requeued"])  # type: ignore[misc]
        for partition, start, end, worker_id, attempt in state["leases"]:
            key = (int(partition), int(start))
            queue.leases.grant(key, Lease(str(worker_id), now + queue.spec.lease_s, int(attempt)))
            queue.ends[key] = int(end)
        queue.failure = state["failure"]
        queue.stopped = bool(state.get("stopped", False))
        queue.restore_token = state.get("restore_token")
        queue.lost_records = int(state.get("lost_records", 0))
        queue.dropped = [(int(p), int(s), int(e)) for p, s, e in state.get("dropped", [])]
        return queue


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` sorted, with overlapping or touching ones joined."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _minus(spans: list[tuple[int, int]], holes: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of merged ``spans`` outside merged ``holes``."""
    out: list[tuple[int, int]] = []
    for start, end in spans:
        for hole_start, hole_end in holes:
            if hole_end <= start or hole_start >= end:
                continue
            if hole_start > start:
                out.append((start, hole_start))
            start = max(start, hole_end)
        if end > start:
            out.append((start, end))
    return out


def _overlap(spans: list[tuple[int, int]], start: int, end: int) -> bool:
    return any(s < end and start < e for s, e in spans)
