"""Trainer-side sharding client: leases shards from the master ahead of need, reports them done."""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time

from dlrover.api.retry import while_unreachable
from dlrover.backoff import Backoff
from dlrover.client.sharding_transport import ShardingTransport
from dlrover.constants import DEFAULT_MASTER_RECONNECT_S
from dlrover.sharding.config import (
    DEFAULT_FETCH_TIMEOUT_S,
    DEFAULT_POLL_INTERVAL_S,
    DEFAULT_PREFETCH_SHARDS,
)
from dlrover.sharding.errors import InvalidSpecError, ShardingError, ShardingTimeoutError
from dlrover.sharding.types import (
    ConsumptionMark,
    DatasetSpec,
    Position,
    RegisterResult,
    ReportResult,
    Shard,
)

logger = logging.getLogger(__name__)


class _Finished:
    """Queue marker: the dataset has no more shards for anyone."""


_FINISHED = _Finished()


class ShardingClient:
    """Reads one dataset shard by shard for one worker.

    A background thread keeps up to `prefetch` shards leased and queued, so `next_shard()`
    returns at once in steady state. While the consumer shows activity (any call, or
    `touch()`), the thread renews this worker's leases every lease_s / 3; a worker that
    stops consuming lets them expire and the master hands them to others. Every wait has
    a deadline; a failure of the background thread is raised by the next `next_shard()`.

    With `max_shards`, the client leases at most that many shards in its life (prefetched ones
    included), and `next_shard()` returns None once it has handed all of them out: a rank of
    a synchronous job never takes more than its share (dlrover.sharding.lockstep).
    """

    def __init__(
        self,
        transport: ShardingTransport,
        spec: DatasetSpec,
        worker_id: str,
        prefetch: int = DEFAULT_PREFETCH_SHARDS,
        fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
        max_shards: int | None = None,
    ) -> None:
        if prefetch < 1:
            raise InvalidSpecError(f"prefetch must be >= 1 shard, got {prefetch}")
        if max_shards is not None and max_shards < 0:
            raise InvalidSpecError(f"max_shards must be >= 0, got {max_shards}")
        self.transport = transport
        self.spec = spec
        self.worker_id = worker_id
        self.prefetch = prefetch
        self.fetch_timeout_s = fetch_timeout_s
        self.poll_interval_s = poll_interval_s
        self.max_shards = max_shards
        self._leased = 0
        """Shards leased so far (since the last restore), counted against max_shards."""
        self._fetching_stopped = False
        self._queue: queue.Queue[Shard | _Finished | BaseException] = queue.Queue()
        # Held by the prefetcher for one fetch-and-enqueue, and by restore_position, so a
        # restore never races a fetch whose shards the restore has just invalidated.
        self._fetch_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._queued = 0
        self._finished = False
        self._drained = threading.Event()
        """Set while the master's last answer was: nothing to hand out now, not finished."""
        self._activity = time.monotonic()
        self._thread: threading.Thread | None = None
        self.registration: RegisterResult | None = None

    # --- lifecycle ------------------------------------------------------------------------
    def start(self) -> ShardingClient:
        """Register the dataset (a no-op if it exists) and start prefetching."""
        self.registration = self.transport.register_dataset(self.spec)
        if self._thread is None or not self._thread.is_alive():
            self._start_thread()
        return self

    def _start_thread(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._prefetch_loop, name=f"shard-prefetch-{self.worker_id}", daemon=True
        )
        self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the prefetcher. Shards still queued stay leased until the master recovers this
        worker or their leases expire."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning(
                    "prefetcher of %s did not stop within %.1fs", self.worker_id, timeout_s
                )
            self._thread = None

    def __enter__(self) -> ShardingClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- consumer side --------------------------------------------------------------------
    def next_shard(
        self, timeout_s: float | None = None, until_drained: bool = False
    ) -> Shard | None:
        """The next leased shard, or None once the dataset is finished for every worker.

        With `until_drained`, None also as soon as the master has nothing to hand out right
        now (what is left is leased to workers, this one included): a reader that must finish
        its own shards before the others can finish (the elastic sampler) stops there.
        """
        self.touch()
        if self._finished:
            return None
        if self._no_more_leases() and self._queue.empty():
            return None
        wait_s = self.fetch_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                # Short slices so a drained master is noticed without waiting the full deadline.
                item = self._queue.get(timeout=max(0.0, min(remaining, self.poll_interval_s)))
                break
            except queue.Empty:
                if until_drained and self._drained.is_set() and self._queue.empty():
                    return None
                if self._no_more_leases() and self._queue.empty():
                    return None
                if remaining <= 0:
                    raise ShardingTimeoutError(
                        f"worker {self.worker_id} waited {wait_s:.1f}s for a shard of dataset "
                        f"{self.spec.name!r}; the master did not answer or every remaining shard "
                        f"stayed leased to other workers. Check the master and the other workers."
                    ) from None
        if isinstance(item, BaseException):
            raise item
        if isinstance(item, _Finished):
            self._finished = True
            return None
        with self._count_lock:  # not _fetch_lock: a step must never wait on an RPC
            self._queued -= 1
        self._wake.set()
        return item

    def _no_more_leases(self) -> bool:
        with self._count_lock:
            spent = self.max_shards is not None and self._leased >= self.max_shards
        return spent or self._fetching_stopped

    def stop_fetching(self) -> None:
        """Lease nothing more (leases held keep being renewed). Waits (bounded) for a fetch in
        flight, so a shard it brings is queued for `next_shard()` rather than leased and never
        read: a reader that stops once the master is drained calls this, then takes what is
        queued."""
        if not self._fetch_lock.acquire(timeout=self.fetch_timeout_s):
            raise ShardingTimeoutError(
                f"worker {self.worker_id}: a fetch of dataset {self.spec.name!r} did not end "
                f"within {self.fetch_timeout_s:.0f}s; the master does not answer"
            )
        try:
            self._fetching_stopped = True
        finally:
            self._fetch_lock.release()

    def report_done(self, shard: Shard) -> ReportResult:
        """Tell the master this worker finished ``shard``; a shard that is no longer open counts as
        ignored in the result."""
        self.touch()
        return self.transport.report_done(self.spec.name, self.worker_id, [shard.id])

    def report_progress(self, shard: Shard, consumed: int) -> bool:
        """Tell the master the first `consumed` samples of `shard` (in its order) are trained."""
        self.touch()
        return self.transport.report_progress(self.spec.name, self.worker_id, shard.id, consumed)

    def touch(self) -> None:
        """Mark this worker as making progress, so its leases keep being renewed."""
        self._activity = time.monotonic()

    def get_position(self) -> Position:
        """The dataset's consumed position now, for all workers (shards in flight are pending); for
        the position at a given step use ``position_at``."""
        return self.transport.get_position(self.spec.name)

    def mark(self, mark: ConsumptionMark) -> None:
        """Tell the master where this worker stands in its iteration (before yielding a shard)."""
        self.touch()
        self.transport.mark_consumption(self.spec.name, self.worker_id, mark)

    def position_at(self, epoch: int, consumed: int, timeout_s: float | None = None) -> Position:
        """The position when every worker had consumed `consumed` samples of iteration `epoch`.

        Waits (bounded) for workers whose marks do not reach that far yet; in a synchronous
        job (DDP) they reached it before the step that the caller completed, so the first
        answer is final.
        """
        wait_s = self.fetch_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        backoff = Backoff(0.005, 0.2)
        while True:
            answer = self.transport.position_at(self.spec.name, epoch, consumed)
            if answer.position is not None:
                return answer.position
            if time.monotonic() >= deadline:
                raise ShardingTimeoutError(
                    f"dataset {self.spec.name!r}: workers {list(answer.waiting_for)} did not "
                    f"reach sample {consumed} of epoch {epoch} within {wait_s:.0f}s, so the "
                    f"position at that step is unknown. Pass state_dict() the step that every "
                    f"rank has completed in this epoch."
                )
            # Waiting on other processes' progress, which reaches us only by asking again.
            time.sleep(min(backoff.next(), max(0.0, deadline - time.monotonic())))

    def restore_position(self, position: Position, token: str | None = None) -> bool:
        """Reset the master to `position`, dropping this client's prefetched shards."""
        if not self._fetch_lock.acquire(timeout=self.fetch_timeout_s):
            raise ShardingTimeoutError(
                f"worker {self.worker_id}: prefetcher held its lock too long"
            )
        try:
            applied = self.transport.restore_position(position, token)
            # Queued shards were leases under the old position; the restore cleared them.
            drained: list[Shard | _Finished | BaseException] = []
            while True:
                try:
                    drained.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            with self._count_lock:
                self._queued = 0
                self._leased = 0
            self._finished = False
            self._fetching_stopped = False
            self._drained.clear()
        finally:
            self._fetch_lock.release()
        if self._thread is None or not self._thread.is_alive():
            self._start_thread()
        self._wake.set()
        return applied

    # --- prefetcher -----------------------------------------------------------------------
    def _prefetch_loop(self) -> None:
        renew_every_s = self.spec.lease_s / 3
        last_renew = time.monotonic()
        while not self._stop.is_set():
            # Cleared before the fetch, so a shard taken meanwhile still wakes the next round.
            self._wake.clear()
            try:
                with self._fetch_lock:
                    with self._count_lock:
                        free = self.prefetch - self._queued
                        if self.max_shards is not None:
                            free = min(free, self.max_shards - self._leased)
                    result = None
                    if free > 0 and not self._fetching_stopped:
                        # A master being restarted is waited for, as agents wait for it:
                        # training goes on from the queue meanwhile.
                        result = while_unreachable(
                            functools.partial(
                                self.transport.fetch_shards, self.spec.name, self.worker_id, free
                            ),
                            time.monotonic() + DEFAULT_MASTER_RECONNECT_S,
                            f"worker {self.worker_id}: fetching shards",
                        )
                        for shard in result.shards:
                            self._queue.put_nowait(shard)
                        with self._count_lock:
                            self._queued += len(result.shards)
                            self._leased += len(result.shards)
                        if result.shards or result.finished:
                            self._drained.clear()
                        else:
                            self._drained.set()
                now = time.monotonic()
                if now - last_renew >= renew_every_s:
                    if self._activity > last_renew:
                        self.transport.renew_leases(self.spec.name, self.worker_id)
                    last_renew = now
            except ShardingError as error:
                self._queue.put_nowait(error)
                return
            except Exception as error:  # a transport failure must reach the consumer, not vanish
                self._queue.put_nowait(
                    ShardingError(f"worker {self.worker_id}: fetching shards failed: {error!r}")
                )
                return
            if result is not None and not result.shards and result.finished:
                self._queue.put_nowait(_FINISHED)
                return
            if result is not None and not result.shards:
                # Everything left is leased to others: poll, in case a holder fails.
                self._stop.wait(self.poll_interval_s)
            else:
                self._wake.wait(min(renew_every_s, 1.0))
