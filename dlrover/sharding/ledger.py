"""Which samples each worker had consumed at a given step: the master's side of state_dict(step).

A worker reports, before it yields the first sample of a shard, where that shard starts in the
sequence of samples it consumes in the current iteration (one dataset epoch). From these marks
the master can say, for "every rank trained `consumed` samples of iteration `epoch`", which
shards were done and how far into the current one each worker was, without any collective among
the ranks and whatever the workers reported since (they may be a step ahead).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
"""What names a shard: a ShardId for datasets, (partition, start offset) for streams."""


@dataclass(frozen=True)
class _Span(Generic[K]):
    begin: int
    shard_id: K
    offset: int
    count: int


@dataclass
class WorkerLedger(Generic[K]):
    """One worker's marks in its current iteration (older iterations have ended)."""

    epoch: int = -1
    spans: list[_Span[K]] = field(default_factory=list)
    ended_at: int | None = None
    """Samples consumed when the iteration ended; None while it goes on."""

    def record(
        self, epoch: int, begin: int, shard_id: K | None, offset: int, shard_length: int
    ) -> None:
        """Add a mark (the fields of a ConsumptionMark): one of a newer epoch (or a shard at
        ``begin`` 0) starts a new iteration, a late one of an older epoch is dropped, one without
        a shard ends the iteration."""
        if epoch > self.epoch or (begin == 0 and shard_id is not None):
            # A new iteration (or the same epoch iterated again from its start).
            self.epoch, self.spans, self.ended_at = epoch, [], None
        elif epoch < self.epoch:
            return  # a late mark of an iteration this worker has left
        if shard_id is None:
            self.ended_at = begin
            return
        count = max(0, shard_length - offset)
        self.spans.append(_Span(begin, shard_id, offset, count))

    def covers(self, consumed: int) -> bool:
        """Whether the marks reach sample `consumed` (or the iteration ended before it)."""
        if self.ended_at is not None:
            return True
        return bool(self.spans) and self.spans[-1].begin + self.spans[-1].count >= consumed

    def consumed_in(self, consumed: int, ahead: bool) -> list[tuple[K, int, int]]:
        """(shard, samples of it consumed in shard order, its length from 0) per span: all of
        it before `consumed`, for an iteration `ahead` of the asked one none of it."""
        out = []
        for span in self.spans:
            used = 0 if ahead else min(span.count, max(0, consumed - span.begin))
            out.append((span.shard_id, span.offset + used, span.offset + span.count))
        return out

    def prune(self, consumed: int, is_open: Callable[[K], bool]) -> None:
        """Forget spans that end by ``consumed`` and whose shard is no longer open."""
        self.spans = [s for s in self.spans if s.begin + s.count > consumed or is_open(s.shard_id)]

    def drop(self, shard_ids: set[K]) -> None:
        """Forget the spans of these shards (they went back to the queue)."""
        self.spans = [span for span in self.spans if span.shard_id not in shard_ids]


class Ledgers(Generic[K]):
    """The marks of every worker of one dataset or stream (kept in memory only: see
    docs/sharding.md)."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerLedger[K]] = {}

    def record(
        self,
        worker_id: str,
        epoch: int,
        begin: int,
        shard_id: K | None,
        offset: int,
        shard_length: int,
    ) -> None:
        """Record a mark of ``worker_id`` (see WorkerLedger.record); ``shard_length`` is the marked
        shard's length (0 for a mark without a shard)."""
        self._workers.setdefault(worker_id, WorkerLedger()).record(
            epoch, begin, shard_id, offset, shard_length
        )

    def forget_worker(self, worker_id: str) -> None:
        """Drop every mark of ``worker_id`` (its shards went back to the queue)."""
        self._workers.pop(worker_id, None)

    def end(self, worker_id: str) -> None:
        """``worker_id`` is gone: its iteration ended where its marks end, so a position is not
        waited for it, and the shards it finished after a step stay not consumed at that step."""
        ledger = self._workers.get(worker_id)
        if ledger is not None and ledger.ended_at is None:
            ledger.ended_at = max((s.begin + s.count for s in ledger.spans), default=0)

    def forget_shards(self, shard_ids: set[K]) -> None:
        """Drop every worker's marks of these shards (their leases expired)."""
        for ledger in self._workers.values():
            ledger.drop(shard_ids)

    def prune(self, consumed: int, is_open: Callable[[K], bool]) -> None:
        """Forget every worker's spans that end by ``consumed`` and whose shard is no longer open
        (a position before ``consumed`` will not be asked for again)."""
        for ledger in self._workers.values():
            ledger.prune(consumed, is_open)

    def trim(self, worker_id: str, keep: int, is_open: Callable[[K], bool]) -> None:
        """Past ``keep`` spans, forget the older half of the worker's closed ones."""
        ledger = self._workers.get(worker_id)
        if ledger is not None and len(ledger.spans) > keep:
            ledger.prune(ledger.spans[len(ledger.spans) // 2].begin, is_open)

    def cut(self, worker_id: str, shard_id: K, new_id: K, count: int) -> None:
        """``worker_id`` yielded only the first ``count`` records of ``shard_id``: its span of it
        now names ``new_id`` (that part) and ends there; it is dropped when ``count`` is 0."""
        ledger = self._workers.get(worker_id)
        if ledger is None:
            return
        spans = [span for span in ledger.spans if span.shard_id != shard_id]
        spans += [
            _Span(span.begin, new_id, span.offset, min(count, span.count))
            for span in ledger.spans
            if span.shard_id == shard_id and count > 0
        ]
        ledger.spans = sorted(spans, key=lambda span: span.begin)

    def clear(self) -> None:
        """Drop all marks (the dataset was restored)."""
        self._workers.clear()

    def at(self, epoch: int, consumed: int) -> tuple[dict[K, tuple[int, int]], list[str]]:
        """Each marked shard -> (samples consumed, its end) when every worker had trained
        `consumed` samples of iteration `epoch`; and the workers whose marks do not reach that
        far yet (the caller asks again: they are about to report)."""
        shards: dict[K, tuple[int, int]] = {}
        waiting: list[str] = []
        for worker_id, ledger in sorted(self._workers.items()):
            if ledger.epoch < epoch:
                if ledger.ended_at is None:
                    waiting.append(worker_id)  # still in an earlier iteration
                continue  # that iteration ended: everything in it was consumed and reported
            if ledger.epoch == epoch and not ledger.covers(consumed):
                waiting.append(worker_id)
                continue
            for shard_id, used, end in ledger.consumed_in(consumed, ahead=ledger.epoch > epoch):
                shards[shard_id] = (used, end)
        return shards, waiting
