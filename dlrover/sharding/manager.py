"""The master's registry of datasets and streams: one entry point for every sharding request."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dlrover.sharding.dataset_queue import DatasetQueue
from dlrover.sharding.errors import DatasetConflictError, InvalidSpecError, UnknownDatasetError
from dlrover.sharding.stream import (
    StreamFetchResult,
    StreamMark,
    StreamPosition,
    StreamPositionAt,
    StreamProgress,
    StreamQueue,
    StreamSource,
    StreamSpec,
)
from dlrover.sharding.types import (
    ConsumptionMark,
    DatasetProgress,
    DatasetSpec,
    DeliveryMode,
    FetchResult,
    Position,
    PositionAt,
    RegisterResult,
    ReportResult,
    ShardId,
)

logger = logging.getLogger(__name__)

STATE_VERSION = 2


class ShardManager:
    """Datasets and streams by name, their queues, leases and positions. Pure logic, no I/O.

    Not thread-safe: the caller (the master's ShardingService, or InProcessTransport) serialises
    calls. Time comes only from the injected `clock`, so tests step it by hand; `tick()` is
    the one periodic duty (reassigning expired leases).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._datasets: dict[str, DatasetQueue] = {}
        self._streams: dict[str, StreamQueue] = {}
        self._track_leases = False

    # --- datasets -------------------------------------------------------------------------
    def register_dataset(self, spec: DatasetSpec) -> RegisterResult:
        """Create the dataset; the same spec again is a no-op, a different one an error."""
        existing = self._datasets.get(spec.name)
        if existing is not None:
            if existing.spec != spec:
                raise DatasetConflictError(
                    f"dataset {spec.name!r} is already registered with {existing.spec}; "
                    f"the new registration has {spec}. Use a new name for a different dataset, "
                    f"or register with the same parameters (a restarted worker re-registering "
                    f"never resets progress)."
                )
            return RegisterResult(spec.name, created=False)
        queue = DatasetQueue(spec)
        if self._track_leases:
            queue.leases.track()
        self._datasets[spec.name] = queue
        logger.info("dataset registered: %s (%d shards)", spec, spec.num_shards)
        return RegisterResult(spec.name, created=True)

    def fetch_shards(self, dataset: str, worker_id: str, max_count: int = 1) -> FetchResult:
        """Lease up to ``max_count`` shards of ``dataset`` to ``worker_id`` (see
        DatasetQueue.fetch). Raises UnknownDatasetError, InvalidSpecError for ``max_count`` < 1, and
        ShardRetriesExhaustedError once a shard was lost more often than the dataset allows."""
        return self._dataset(dataset).fetch(worker_id, max_count, self._clock())

    def report_done(
        self, dataset: str, worker_id: str, shard_ids: Sequence[ShardId]
    ) -> ReportResult:
        """``worker_id`` finished these shards: they are done and their leases released; a shard
        that is not open counts as ignored. Raises UnknownDatasetError."""
        return self._dataset(dataset).report_done(worker_id, list(shard_ids))

    def report_progress(
        self, dataset: str, worker_id: str, shard_id: ShardId, consumed: int
    ) -> bool:
        """``worker_id`` trained the first ``consumed`` samples (shard order) of ``shard_id``;
        renews that lease. False if the worker no longer holds it. Raises InvalidSpecError when
        ``consumed`` is outside the shard, UnknownDatasetError."""
        return self._dataset(dataset).report_progress(worker_id, shard_id, consumed, self._clock())

    def renew_leases(self, dataset: str, worker_id: str) -> int:
        """Extend every lease ``worker_id`` holds in ``dataset`` to the dataset's ``lease_s`` from
        now; returns how many. Raises UnknownDatasetError."""
        return self._dataset(dataset).renew(worker_id, self._clock())

    def get_position(self, dataset: str) -> Position:
        """The dataset's consumed position now, in canonical form (shards in flight are pending), to
        save with a checkpoint. Raises UnknownDatasetError."""
        return self._dataset(dataset).position()

    def mark_consumption(self, dataset: str, worker_id: str, mark: ConsumptionMark) -> None:
        """Record where ``worker_id`` stands in its iteration (see ConsumptionMark), for
        ``position_at``. Raises InvalidSpecError for a shard or offset that does not exist,
        UnknownDatasetError."""
        self._dataset(dataset).mark(worker_id, mark)

    def position_at(self, dataset: str, epoch: int, consumed: int) -> PositionAt:
        """The position when every worker had consumed ``consumed`` samples of iteration ``epoch``,
        from their marks; ``waiting_for`` names workers whose marks do not reach that far yet.
        Raises InvalidSpecError for negative arguments, UnknownDatasetError."""
        return self._dataset(dataset).position_at(epoch, consumed)

    def restore_position(self, position: Position, token: str | None = None) -> bool:
        """Reset the dataset's queues to `position`. Returns False when `token` was applied last,
        so every rank of a job can restore the same checkpoint and only the first one acts."""
        return self._dataset(position.dataset).restore(position, token)

    def dataset_progress(self, dataset: str) -> DatasetProgress:
        """Counters of the dataset (todo, leased, done, finished). Raises UnknownDatasetError."""
        return self._dataset(dataset).progress()

    def datasets(self) -> list[str]:
        """Names of the registered datasets, sorted."""
        return sorted(self._datasets)

    def _dataset(self, name: str) -> DatasetQueue:
        queue = self._datasets.get(name)
        if queue is None:
            raise UnknownDatasetError(
                f"dataset {name!r} is not registered (known: {sorted(self._datasets)}); "
                f"call register_dataset first"
            )
        return queue

    # --- streams --------------------------------------------------------------------------
    def register_stream(
        self, spec: StreamSpec, source: StreamSource, start: dict[int, int] | None = None
    ) -> RegisterResult:
        """Create the stream over ``source``, reading each partition from ``start`` (default:
        asked of the source); the same spec again is a no-op, a different one raises
        DatasetConflictError."""
        existing = self._streams.get(spec.name)
        if existing is not None:
            if existing.spec != spec:
                raise DatasetConflictError(
                    f"stream {spec.name!r} is already registered with {existing.spec}, not {spec}"
                )
            return RegisterResult(spec.name, created=False)
        self._streams[spec.name] = StreamQueue(spec, source, start)
        return RegisterResult(spec.name, created=True)

    def fetch_stream_shards(
        self, stream: str, worker_id: str, max_count: int = 1
    ) -> StreamFetchResult:
        """Lease up to ``max_count`` record ranges of ``stream`` to ``worker_id`` (see
        StreamQueue.fetch); none when no new records are available. Raises UnknownDatasetError,
        ShardRetriesExhaustedError."""
        return self._stream(stream).fetch(worker_id, max_count, self._clock())

    def report_stream_done(
        self, stream: str, worker_id: str, shards: Sequence[tuple[int, int]]
    ) -> int:
        """Mark shards, named by (partition, start offset), as done; only those ``worker_id``
        holds, or that are back in the queue, count; returns how many."""
        return self._stream(stream).report_done(worker_id, shards)

    def return_stream_shards(
        self, stream: str, worker_id: str, remainders: Sequence[tuple[int, int, int, int]]
    ) -> int:
        """Take back ranges the worker will not read further (see StreamQueue.give_back)."""
        return self._stream(stream).give_back(worker_id, remainders)

    def renew_stream_leases(self, stream: str, worker_id: str) -> int:
        """Extend every lease ``worker_id`` holds on ``stream``; returns how many."""
        return self._stream(stream).renew(worker_id, self._clock())

    def mark_stream(self, stream: str, worker_id: str, mark: StreamMark) -> bool:
        """Record where ``worker_id`` stands in its pass over ``stream`` (see StreamMark); False
        for a range it does not hold."""
        return self._stream(stream).mark(worker_id, mark)

    def mark_stream_ranges(self, stream: str, worker_id: str, marks: Sequence[StreamMark]) -> int:
        """Record several marks in order (see StreamQueue.mark_all); returns how many were."""
        return self._stream(stream).mark_all(worker_id, marks)

    def stream_position_at(self, stream: str, consumed: int) -> StreamPositionAt:
        """The position when every worker had yielded ``consumed`` records of its current pass."""
        return self._stream(stream).position_at(consumed)

    def stream_committed(self, stream: str) -> dict[int, int]:
        """Per partition, the offset below which every record of ``stream`` is done (what is
        committed to the broker). Raises UnknownDatasetError."""
        return self._stream(stream).committed()

    def restore_stream(self, position: StreamPosition, token: str | None = None) -> bool:
        """Restart the stream at ``position``, dropping every lease; a repeat of the last applied
        ``token`` is a no-op (False). Raises InvalidPositionError, UnknownDatasetError."""
        return self._stream(position.stream).restore(position, token)

    def stop_stream(self, stream: str) -> StreamProgress:
        """Cut no new shards of ``stream``: it ends once the ranges in flight are done."""
        queue = self._stream(stream)
        queue.stop()
        return queue.progress()

    def stream_progress(self, stream: str) -> StreamProgress:
        """The stream's counters (see StreamProgress)."""
        return self._stream(stream).progress()

    def streams(self) -> list[str]:
        """Names of the registered streams."""
        return sorted(self._streams)

    def losses(self) -> str:
        """What the at-most-once datasets and streams lost, in one line ("" when none is
        at-most-once): `dlrover status` shows it, so no loss goes unseen."""
        parts = [
            f"dataset {name} {q.lost_samples} samples ({q.lost_shards} shards)"
            for name, q in sorted(self._datasets.items())
            if q.spec.mode is DeliveryMode.AT_MOST_ONCE
        ]
        parts += [
            f"stream {name} {q.lost_records} records"
            for name, q in sorted(self._streams.items())
            if q.spec.mode is DeliveryMode.AT_MOST_ONCE
        ]
        return "at-most-once data lost: " + ", ".join(parts) if parts else ""

    def _stream(self, name: str) -> StreamQueue:
        queue = self._streams.get(name)
        if queue is None:
            raise UnknownDatasetError(f"stream {name!r} is not registered; call register_stream")
        return queue

    # --- failures and time ----------------------------------------------------------------
    def recover_worker(self, worker_id: str) -> int:
        """Return every shard `worker_id` holds, in every dataset and stream, to its queue head."""
        count = 0
        for queue in self._datasets.values():
            count += len(queue.recover_worker(worker_id))
        for stream in self._streams.values():
            count += len(stream.recover_worker(worker_id))
        if count:
            logger.info("recovered %d shards of worker %s", count, worker_id)
        return count

    def recover_node(self, node_id: str) -> int:
        """Recover every worker of a node: worker ids are `<node_id>/<local_rank>` by convention."""
        workers: set[str] = set()
        for queue in self._datasets.values():
            workers.update(lease.worker_id for _, lease in queue.leases.items())
        for stream in self._streams.values():
            workers.update(lease.worker_id for _, lease in stream.leases.items())
        prefix = f"{node_id}/"
        return sum(self.recover_worker(w) for w in sorted(workers) if w.startswith(prefix))

    def tick(self, now: float | None = None) -> int:
        """Reassign every lease past its deadline; returns how many shards went back."""
        now = self._clock() if now is None else now
        count = sum(len(q.expire(now)) for q in self._datasets.values())
        count += sum(len(s.expire(now)) for s in self._streams.values())
        return count

    # --- state ----------------------------------------------------------------------------
    def to_state(self, dataset_leases: bool = True) -> dict[str, Any]:
        """JSON-able state, sized by shards in flight, not by dataset size (``dataset_leases``
        False: without the datasets' leases, which the caller keeps from `lease_changes`)."""
        return {
            "version": STATE_VERSION,
            "datasets": [q.to_state(dataset_leases) for q in self._datasets.values()],
            "streams": [s.to_state() for s in self._streams.values()],
        }

    def track_lease_changes(self) -> None:
        """Keep each dataset's lease changes from now on (every lease held now counted as one),
        for a caller that saves them key by key (`lease_changes`, `lease_changes_saved`)."""
        self._track_leases = True
        for queue in self._datasets.values():
            queue.leases.track()

    def lease_changes(self) -> dict[str, dict[tuple[int, int], list[Any] | None]]:
        """Per dataset, its leases changed since `lease_changes_saved`
        (`DatasetQueue.lease_changes`)."""
        changes = {name: q.lease_changes() for name, q in self._datasets.items()}
        return {name: c for name, c in changes.items() if c}

    def lease_changes_saved(self) -> None:
        """What `lease_changes` returned is saved."""
        for queue in self._datasets.values():
            queue.leases.changes_saved()

    @classmethod
    def from_state(
        cls,
        state: dict[str, Any],
        clock: Callable[[], float] = time.monotonic,
        sources: Mapping[str, StreamSource] | None = None,
    ) -> ShardManager:
        """Rebuild a manager saved by to_state() (of this release or the one before, whose
        version 1 is the same with every dataset's leases in it); streams need their sources
        passed by name."""
        if state.get("version") not in (1, STATE_VERSION):
            raise InvalidSpecError(
                f"sharding state version {state.get('version')!r} is not {STATE_VERSION}: it was "
                "written by a newer DLRover; run the master of that release"
            )
        manager = cls(clock)
        now = clock()
        for entry in state["datasets"]:
            queue = DatasetQueue.from_state(entry, now)
            manager._datasets[queue.spec.name] = queue
        for entry in state["streams"]:
            name = entry["spec"]["name"]
            if sources is None or name not in sources:
                raise UnknownDatasetError(
                    f"stream {name!r} is in the state but no source was given"
                )
            manager._streams[name] = StreamQueue.from_state(entry, sources[name], now)
        return manager
