"""Shards of an unbounded source, split by (partition, offset range), with leases like datasets."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from dlrover.sharding.config import DEFAULT_LEASE_S, DEFAULT_MAX_RETRIES
from dlrover.sharding.errors import InvalidSpecError, ShardRetriesExhaustedError
from dlrover.sharding.leases import Lease, LeaseTable

logger = logging.getLogger(__name__)


class StreamSource(Protocol):
    """What the master needs to know of a stream: its partitions and how far each has grown."""

    def partitions(self) -> Sequence[int]:
        """The partition numbers; a StreamQueue reads them once, when it is created."""
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

    def end_offset(self, partition: int) -> int:
        """One past the last record appended to ``partition``."""
        return self._ends[partition]

    def append(self, partition: int, count: int) -> None:
        """Make ``count`` more records available in ``partition``."""
        self._ends[partition] += count


@dataclass(frozen=True)
class StreamSpec:
    """A registered stream: records per shard, retries and lease time, as for datasets."""

    name: str
    records_per_shard: int
    max_retries: int = DEFAULT_MAX_RETRIES
    lease_s: float = DEFAULT_LEASE_S

    def __post_init__(self) -> None:
        if not self.name or self.records_per_shard < 1 or self.max_retries < 0 or self.lease_s <= 0:
            raise InvalidSpecError(
                f"stream {self.name!r}: needs a name, records_per_shard >= 1, max_retries >= 0 "
                f"and lease_s > 0 (got {self.records_per_shard}, {self.max_retries}, "
                f"{self.lease_s})"
            )


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


class StreamQueue:
    """Leases offset ranges of a stream's partitions; lost ones go back to the queue head.

    The committed position of a partition is the lowest offset not known to be done: the
    smaller of its read cursor and the start of its earliest shard in flight or requeued.
    """

    def __init__(self, spec: StreamSpec, source: StreamSource) -> None:
        self.spec = spec
        self.source = source
        self.next_offset: dict[int, int] = {p: 0 for p in source.partitions()}
        self.requeued: deque[tuple[int, int, int, int]] = deque()
        self.leases: LeaseTable[_StreamKey] = LeaseTable()
        self.ends: dict[_StreamKey, int] = {}
        self.failure: str | None = None
        self._next_partition = 0

    def fetch(self, worker_id: str, max_count: int, now: float) -> list[StreamShard]:
        """Lease up to ``max_count`` record ranges to ``worker_id`` until ``now + lease_s``:
        requeued ranges first, then new ones of up to ``records_per_shard`` records, cut round-robin
        over the partitions; fewer when no new records are available. Raises
        ShardRetriesExhaustedError once a range was lost more than ``max_retries`` times."""
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
        return shards

    def _cut_new(self) -> tuple[int, int, int, int] | None:
        # Round-robin over partitions so one busy partition does not starve the others.
        partitions = list(self.next_offset)
        for step in range(len(partitions)):
            partition = partitions[(self._next_partition + step) % len(partitions)]
            start = self.next_offset[partition]
            end = min(start + self.spec.records_per_shard, self.source.end_offset(partition))
            if end > start:
                self.next_offset[partition] = end
                self._next_partition = (self._next_partition + step + 1) % len(partitions)
                return (partition, start, end, 0)
        return None

    def report_done(self, worker_id: str, shards: Sequence[tuple[int, int]]) -> int:
        """Mark ranges, named by (partition, start), as done, whoever holds them; returns how many
        were open (leased or requeued)."""
        accepted = 0
        for key in shards:
            if self.leases.release(key) is not None:
                self.ends.pop(key, None)
                accepted += 1
            else:
                before = len(self.requeued)
                self.requeued = deque(e for e in self.requeued if (e[0], e[1]) != key)
                accepted += before - len(self.requeued)
        return accepted

    def recover_worker(self, worker_id: str) -> list[_StreamKey]:
        """Put every range ``worker_id`` holds back at the head of the queue; returns their keys."""
        return self._requeue(sorted(self.leases.held_by(worker_id)), f"worker {worker_id} lost")

    def expire(self, now: float) -> list[_StreamKey]:
        """Requeue every range whose lease deadline is at or before ``now``; returns their keys."""
        return self._requeue(sorted(self.leases.expired(now)), "lease expired")

    def _requeue(self, keys: list[_StreamKey], reason: str) -> list[_StreamKey]:
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
        return [(p, s) for p, s, _, _ in back]

    def committed(self) -> dict[int, int]:
        """Per partition, the offset below which every record is done."""
        low = dict(self.next_offset)
        in_flight = [(p, s) for p, s, _, _ in self.requeued] + [k for k, _ in self.leases.items()]
        for partition, start in in_flight:
            low[partition] = min(low[partition], start)
        return low

    def restore(self, committed: dict[int, int]) -> None:
        """Restart reading every partition at its committed offset; drops all leases."""
        unknown = set(committed) - set(self.next_offset)
        if unknown:
            raise InvalidSpecError(f"stream {self.spec.name!r} has no partitions {sorted(unknown)}")
        self.next_offset.update(committed)
        self.requeued.clear()
        self.leases.clear()
        self.ends.clear()
        self.failure = None

    def to_state(self) -> dict[str, Any]:
        """JSON-able state: spec, read cursors, requeued ranges and leases."""
        return {
            "spec": asdict(self.spec),
            "next_offset": [[p, o] for p, o in self.next_offset.items()],
            "requeued": [list(e) for e in self.requeued],
            "leases": [
                [k[0], k[1], self.ends[k], lease.worker_id, lease.attempt]
                for k, lease in self.leases.items()
            ],
            "failure": self.failure,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], source: StreamSource, now: float) -> StreamQueue:
        """Rebuild from ``to_state()`` over ``source``; leases restart their full lease time from
        ``now``."""
        queue = cls(StreamSpec(**state["spec"]), source)
        queue.next_offset.update({int(p): int(o) for p, o in state["next_offset"]})
        queue.requeued = deque(tuple(int(x) for x in e) for e in state["requeued"])  # type: ignore[misc]
        for partition, start, end, worker_id, attempt in state["leases"]:
            key = (int(partition), int(start))
            queue.leases.grant(key, Lease(str(worker_id), now + queue.spec.lease_s, int(attempt)))
            queue.ends[key] = int(end)
        queue.failure = state["failure"]
        return queue
