"""Trainer-side client of a stream: leases offset ranges of a Kafka topic from the master."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence

from dlrover.api.errors import UnsupportedCallError
from dlrover.backoff import Backoff
from dlrover.client.sharding_transport import StreamTransport
from dlrover.sharding.config import DEFAULT_FETCH_TIMEOUT_S, DEFAULT_PREFETCH_SHARDS
from dlrover.sharding.errors import InvalidSpecError, ShardingTimeoutError
from dlrover.sharding.stream import (
    StreamFetchResult,
    StreamMark,
    StreamPosition,
    StreamProgress,
    StreamShard,
    StreamSpec,
)
from dlrover.sharding.types import RegisterResult

logger = logging.getLogger(__name__)

MAX_POLL_INTERVAL_S = 1.0
"""Longest pause between two asks for new records while a stream has none."""


class StreamShardingClient:
    """One worker's view of a stream: the record ranges it leases, marks and reports.

    ``poll`` hands out the next leased range (up to ``prefetch`` are leased at once), waiting at
    most its timeout for new records; None with ``finished`` set means the stream has ended for
    every worker. Every call that shows the worker alive renews its leases every lease_s / 3.
    No thread of its own: it runs in the caller's (the data loader's) thread.
    """

    def __init__(
        self,
        transport: StreamTransport,
        spec: StreamSpec,
        worker_id: str,
        prefetch: int = DEFAULT_PREFETCH_SHARDS,
        fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
    ) -> None:
        if prefetch < 1:
            raise InvalidSpecError(f"prefetch must be >= 1 shard, got {prefetch}")
        self.transport = transport
        self.spec = spec
        self.worker_id = worker_id
        self.prefetch = prefetch
        self.fetch_timeout_s = fetch_timeout_s
        self.finished = False
        self.registration: RegisterResult | None = None
        self._leased: deque[StreamShard] = deque()
        self._renewed_at = time.monotonic()
        self._batched_marks = True
        """False once the master did not know MarkStreamRanges (an older release)."""

    def start(self) -> StreamShardingClient:
        """Register the stream (a no-op if it exists; the master reads the topic's partitions)."""
        if self.registration is None:
            self.registration = self.transport.register_stream(self.spec)
        return self

    def begin_pass(self) -> None:
        """A new pass over the stream: whether it has ended is asked of the master again (the
        last pass may have learned it had, then given back ranges it did not read)."""
        self.finished = False

    def poll(self, timeout_s: float) -> StreamShard | None:
        """The next leased record range; None when none came within ``timeout_s`` (no new
        records yet) or the stream has ended (then ``finished`` is True)."""
        self.start()
        self._renew_if_due()
        deadline = time.monotonic() + timeout_s
        backoff = Backoff(0.01, MAX_POLL_INTERVAL_S)
        while not self._leased and not self.finished:
            result = self.transport.fetch_stream_shards(
                self.spec.name, self.worker_id, self.prefetch
            )
            self._leased.extend(result.shards)
            self.finished = result.finished
            remaining = deadline - time.monotonic()
            if self._leased or self.finished or remaining <= 0:
                break
            # New records reach the master only through the broker; ask again shortly.
            time.sleep(min(backoff.next(), remaining))
        return self._leased.popleft() if self._leased else None

    def fetch_ahead(self) -> StreamFetchResult:
        """Lease up to ``prefetch`` more ranges now (one call, no wait for new records) without
        handing them out: a reader runs it in another thread while it reads a range, so the
        round trip overlaps the reading, then gives the result to ``take_leases`` in the thread
        that polls."""
        self.start()
        return self.transport.fetch_stream_shards(self.spec.name, self.worker_id, self.prefetch)

    def take_leases(self, result: StreamFetchResult) -> None:
        """Add the ranges of a ``fetch_ahead`` to those ``poll`` hands out."""
        self._leased.extend(result.shards)
        self.finished = result.finished and not self._leased

    def mark(self, mark: StreamMark) -> bool:
        """Tell the master where this worker stands in its pass (before a range's records); False
        when this worker no longer holds the range (its lease expired): do not yield it."""
        self._renew_if_due()
        return self.transport.mark_stream(self.spec.name, self.worker_id, mark)

    def send_mark(self, mark: StreamMark) -> bool:
        """``mark`` without renewing the leases: safe to call from another thread than the one
        that polls (a reader that has its marks sent while it reads on; it calls
        ``keep_alive`` itself)."""
        return self.transport.mark_stream(self.spec.name, self.worker_id, mark)

    def send_marks(self, marks: Sequence[StreamMark]) -> int:
        """Several marks in one call, in the order their ranges are yielded (like ``send_mark``,
        without renewing the leases); returns how many, from the first, the master recorded:
        the next one's range is no longer this worker's (skip it), the rest were not looked at
        (their begins counted it: mark them again)."""
        batched = getattr(self.transport, "mark_stream_ranges", None)  # a transport of one's own
        if self._batched_marks and batched is not None:
            try:
                return int(batched(self.spec.name, self.worker_id, marks))
            except UnsupportedCallError as error:
                logger.info("marking ranges one per call: %s", error)
                self._batched_marks = False
        for index, mark in enumerate(marks):
            if not self.transport.mark_stream(self.spec.name, self.worker_id, mark):
                return index
        return len(marks)

    def report_done(self, shard: StreamShard) -> int:
        """Tell the master this worker has read every record of ``shard``; 0 when another worker
        holds it now."""
        return self.report_all_done([shard])

    def report_all_done(self, shards: Sequence[StreamShard]) -> int:
        """``report_done`` for several ranges in one call; how many the master took."""
        return self.transport.report_stream_done(
            self.spec.name, self.worker_id, [(shard.partition, shard.start) for shard in shards]
        )

    def leased_shards(self) -> list[StreamShard]:
        """The ranges leased and not handed out by ``poll`` yet (a reader may prepare them)."""
        return list(self._leased)

    def leased_ahead(self) -> int:
        """Ranges leased and not handed out by ``poll`` yet."""
        return len(self._leased)

    def give_back(self, remainders: Sequence[tuple[StreamShard, int, int]]) -> int:
        """Return ranges this worker will not read further (its pass was closed early), each
        with the first offset it did not yield and the records it yielded, and the ranges it
        leased ahead; the master leases the rest again first. Returns how many it took back."""
        entries = list(remainders) + [(shard, shard.start, 0) for shard in self._leased]
        self._leased.clear()
        if not entries:
            return 0
        return self.transport.return_stream_shards(
            self.spec.name,
            self.worker_id,
            [(s.partition, s.start, resume, yielded) for s, resume, yielded in entries],
        )

    def position_at(self, consumed: int, timeout_s: float | None = None) -> StreamPosition:
        """The position when every worker had yielded ``consumed`` records of its current pass.

        Waits (bounded) for workers whose marks do not reach that far yet; in a synchronous
        job they reached it before the step the caller completed, so the first answer is final.
        """
        wait_s = self.fetch_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        backoff = Backoff(0.005, 0.2)
        while True:
            answer = self.transport.stream_position_at(self.spec.name, consumed)
            if answer.position is not None:
                return answer.position
            if time.monotonic() >= deadline:
                raise ShardingTimeoutError(
                    f"stream {self.spec.name!r}: workers {list(answer.waiting_for)} did not "
                    f"reach record {consumed} within {wait_s:.0f}s, so the position at that step "
                    f"is unknown. Call state_dict() after a step that every rank has completed."
                )
            # Other workers' progress reaches us only by asking again.
            time.sleep(min(backoff.next(), max(0.0, deadline - time.monotonic())))

    def restore_position(self, position: StreamPosition, token: str | None = None) -> bool:
        """Restart the stream at ``position`` (once per ``token``); drops the ranges this client
        had leased, which the restore released."""
        self.start()
        applied = self.transport.restore_stream_position(position, token)
        self._leased.clear()
        self.finished = False
        return applied

    def stop(self) -> StreamProgress:
        """End the stream for every worker once the ranges in flight are done."""
        return self.transport.stop_stream(self.spec.name)

    def progress(self) -> StreamProgress:
        """The stream's counters (committed and end offsets per partition)."""
        return self.transport.stream_progress(self.spec.name)

    def keep_alive(self) -> None:
        """Renew this worker's leases if lease_s / 3 has passed since the last renewal (a reader
        waiting for the training loop calls it)."""
        self._renew_if_due()

    def _renew_if_due(self) -> None:
        now = time.monotonic()
        if now - self._renewed_at >= self.spec.lease_s / 3:
            self._renewed_at = now
            self.transport.renew_stream_leases(self.spec.name, self.worker_id)
