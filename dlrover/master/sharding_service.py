"""The master's side of dynamic data sharding: typed calls onto one ShardManager, persisted."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from dlrover.master.state_store import StateStore, StateStoreError
from dlrover.sharding.manager import ShardManager
from dlrover.sharding.stream import (
    BoundedStreamSource,
    StreamFetchResult,
    StreamMark,
    StreamPosition,
    StreamPositionAt,
    StreamProgress,
    StreamSource,
    StreamSpec,
)
from dlrover.sharding.types import (
    ConsumptionMark,
    DatasetProgress,
    DatasetSpec,
    FetchResult,
    Position,
    PositionAt,
    RegisterResult,
    ReportResult,
    ShardId,
)

logger = logging.getLogger(__name__)

_NAMESPACE = "sharding"
_LEASE = "lease/"
"""The prefix of a dataset lease's key in the namespace: ``lease/<dataset>/<epoch>/<index>``."""

SourceFactory = Callable[[StreamSpec, Sequence[int] | None], StreamSource]
"""Builds the source a stream spec names; the partitions when already known (a restart)."""


def _source_for(spec: StreamSpec, partitions: Sequence[int] | None) -> StreamSource:
    """A Kafka topic's source, or a bounded one for a spec that gives only its end offsets."""
    if not spec.topic and spec.end_offsets:
        return BoundedStreamSource(spec.end_offsets)
    from dlrover.sharding.kafka_source import kafka_source_for

    return kafka_source_for(spec, partitions)


def _close(source: StreamSource) -> None:
    close = getattr(source, "close", None)
    if close is not None:
        close()


@dataclass
class Deferred:
    """What the calls inside one `ShardingService.saves_deferred` block left unsaved."""

    changed: bool = False
    """A call changed the state: answer it only after `ShardingService.flush`."""


class ShardingService:
    """Serialises calls onto the ShardManager and saves its state after every change.

    It implements ShardingTransport and StreamTransport (dlrover/api/sharding.py): the master's
    gRPC handlers of those RPCs call it. After each call that changes what a restarted master
    must know, it writes, in one transaction of the store, the manager's state without the
    datasets' leases (index ranges, not samples: a few kilobytes) and the leases that call
    granted, released or moved on, one key each (``lease/<dataset>/<epoch>/<index>``): a call
    costs its change, not the shards in flight (written whole each time, a lease and its report
    cost 10 times more with 1,000 leases held, 68 times with 5,000: sharding.py --leases-held). A
    restarted master rebuilds the manager from both and no registered dataset is reset. Lease
    renewals and consumption marks are not saved: leases get a fresh lease time on restore, and
    marks live in memory only (one per shard a worker starts).
    """

    def __init__(
        self,
        store: StateStore,
        clock: Callable[[], float],
        source_factory: SourceFactory | None = None,
    ) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._deferring = threading.local()
        """``current``: this thread's `Deferred` inside `saves_deferred`."""
        self._unsaved = False
        """Deferred calls changed the state since the last save."""
        self._source_factory = source_factory or _source_for
        self._sources: dict[str, StreamSource] = {}
        saved = store.get_json(_NAMESPACE, "state")
        if saved:
            _attach_leases(saved, store)
            # A restarted master knows each stream's partitions: it needs no broker to start.
            for entry in saved.get("streams", []):
                spec = StreamSpec(**entry["spec"])
                partitions = [int(p) for p, _ in entry["next_offset"]]
                self._sources[spec.name] = self._source_factory(spec, partitions)
            self.manager = ShardManager.from_state(saved, clock, self._sources)
        else:
            self.manager = ShardManager(clock)
        # Leases are saved key by key; every lease held now is written with the first change
        # (those of a state of the release before were inside it, not keys of their own).
        self.manager.track_lease_changes()

    # --- calls that change the saved state ----------------------------------------------------
    def register_dataset(self, spec: DatasetSpec) -> RegisterResult:
        """Register the dataset (ShardManager.register_dataset) and save the state."""
        with self._changing():
            return self.manager.register_dataset(spec)

    def fetch_shards(self, dataset: str, worker_id: str, max_count: int) -> FetchResult:
        """Lease shards to the worker (ShardManager.fetch_shards) and save the state (or leave
        the save to `flush`, inside `saves_deferred`)."""
        with self._changing(deferrable=True):
            return self.manager.fetch_shards(dataset, worker_id, max_count)

    def report_done(
        self, dataset: str, worker_id: str, shard_ids: Sequence[ShardId]
    ) -> ReportResult:
        """Mark shards done (ShardManager.report_done) and save the state (or leave the save to
        `flush`, inside `saves_deferred`)."""
        with self._changing(deferrable=True):
            return self.manager.report_done(dataset, worker_id, shard_ids)

    def report_progress(
        self, dataset: str, worker_id: str, shard_id: ShardId, consumed: int
    ) -> bool:
        """Record progress in a shard (ShardManager.report_progress) and save the state (or
        leave the save to `flush`, inside `saves_deferred`)."""
        with self._changing(deferrable=True):
            return self.manager.report_progress(dataset, worker_id, shard_id, consumed)

    # --- one write for many calls -------------------------------------------------------------
    @contextmanager
    def saves_deferred(self) -> Iterator[Deferred]:
        """In this block, on this thread, the dataset calls that change the state (fetch_shards,
        report_done, report_progress) leave their save to the next `flush`, and say so in the
        yielded `Deferred`. The caller must not answer such a call before a `flush` has
        returned: the master's server answers the calls that come together after one flush,
        one transaction for them all. Every other call, and every call on another thread,
        saves at once, and its save writes the deferred changes too."""
        deferred = Deferred()
        self._deferring.current = deferred
        try:
            yield deferred
        finally:
            self._deferring.current = None

    def flush(self) -> None:
        """Save what the deferred calls changed, if no save has since; raises StateStoreError
        when the store refuses the write (the changes then go with the next save)."""
        with self._lock:
            if self._unsaved:
                self._save()

    def restore_position(self, position: Position, token: str | None) -> bool:
        """Reset the dataset to ``position``, once per ``token`` (ShardManager.restore_position),
        and save the state."""
        with self._changing():
            return self.manager.restore_position(position, token)

    # --- streams --------------------------------------------------------------------------------
    def register_stream(self, spec: StreamSpec) -> RegisterResult:
        """Register the stream over the source its spec names (a Kafka topic) and save the state;
        the broker is asked for the partitions and start offsets outside the lock, and only for
        a new stream. The new source is closed if the registration fails or lost a race."""
        with self._lock:
            if spec.name in self.manager.streams():
                return self.manager.register_stream(spec, self._sources[spec.name])
        source = self._source_factory(spec, None)
        try:
            # Up to two broker round trips per partition: never while holding the lock, which
            # the sharding calls on the server's event loop wait for.
            start = {p: source.start_offset(p) for p in source.partitions()}
            with self._changing():
                if spec.name in self.manager.streams():  # registered meanwhile by another worker
                    result = self.manager.register_stream(spec, self._sources[spec.name])
                else:
                    result = self.manager.register_stream(spec, source, start)
                    self._sources[spec.name] = source
                    return result
        except BaseException:
            _close(source)
            raise
        _close(source)
        return result

    def fetch_stream_shards(self, stream: str, worker_id: str, max_count: int) -> StreamFetchResult:
        """Lease record ranges to the worker (ShardManager.fetch_stream_shards); saves the state
        when any were leased."""
        with self._lock:
            result = self.manager.fetch_stream_shards(stream, worker_id, max_count)
            if result.shards:
                self._save()
            return result

    def report_stream_done(
        self, stream: str, worker_id: str, shards: Sequence[tuple[int, int]]
    ) -> int:
        """Mark ranges done (ShardManager.report_stream_done) and save the state."""
        with self._changing():
            return self.manager.report_stream_done(stream, worker_id, shards)

    def return_stream_shards(
        self, stream: str, worker_id: str, remainders: Sequence[tuple[int, int, int, int]]
    ) -> int:
        """Take back ranges the worker will not read further (ShardManager.return_stream_shards)
        and save the state."""
        with self._changing():
            return self.manager.return_stream_shards(stream, worker_id, remainders)

    def renew_stream_leases(self, stream: str, worker_id: str) -> int:
        """Extend the worker's leases on the stream; not saved."""
        with self._lock:
            return self.manager.renew_stream_leases(stream, worker_id)

    def mark_stream(self, stream: str, worker_id: str, mark: StreamMark) -> bool:
        """Record the worker's mark (ShardManager.mark_stream); kept in memory only."""
        with self._lock:
            return self.manager.mark_stream(stream, worker_id, mark)

    def mark_stream_ranges(self, stream: str, worker_id: str, marks: Sequence[StreamMark]) -> int:
        """Record the worker's marks in order (ShardManager.mark_stream_ranges); in memory only."""
        with self._lock:
            return self.manager.mark_stream_ranges(stream, worker_id, marks)

    def stream_position_at(self, stream: str, consumed: int) -> StreamPositionAt:
        """The stream's position when every worker had yielded ``consumed`` records."""
        with self._lock:
            return self.manager.stream_position_at(stream, consumed)

    def restore_stream_position(self, position: StreamPosition, token: str | None) -> bool:
        """Restart the stream at ``position``, once per ``token``, and save the state."""
        with self._changing():
            return self.manager.restore_stream(position, token)

    def stop_stream(self, stream: str) -> StreamProgress:
        """Cut no new shards of the stream (it ends once those in flight are done); saved."""
        with self._changing():
            return self.manager.stop_stream(stream)

    def stream_progress(self, stream: str) -> StreamProgress:
        """The stream's counters (ShardManager.stream_progress)."""
        with self._lock:
            return self.manager.stream_progress(stream)

    # --- calls that do not --------------------------------------------------------------------
    def renew_leases(self, dataset: str, worker_id: str) -> int:
        """Extend the worker's leases (ShardManager.renew_leases); not saved."""
        with self._lock:
            return self.manager.renew_leases(dataset, worker_id)

    def get_position(self, dataset: str) -> Position:
        """The dataset's consumed position now (ShardManager.get_position)."""
        with self._lock:
            return self.manager.get_position(dataset)

    def mark_consumption(self, dataset: str, worker_id: str, mark: ConsumptionMark) -> None:
        """Record the worker's consumption mark (ShardManager.mark_consumption); kept in memory
        only."""
        with self._lock:
            self.manager.mark_consumption(dataset, worker_id, mark)

    def position_at(self, dataset: str, epoch: int, consumed: int) -> PositionAt:
        """The dataset's position at a step of every worker (ShardManager.position_at)."""
        with self._lock:
            return self.manager.position_at(dataset, epoch, consumed)

    def dataset_progress(self, dataset: str) -> DatasetProgress:
        """The dataset's counters (ShardManager.dataset_progress)."""
        with self._lock:
            return self.manager.dataset_progress(dataset)

    def all_stream_progress(self) -> list[StreamProgress]:
        """Every registered stream's counters (metrics)."""
        with self._lock:
            return [self.manager.stream_progress(name) for name in self.manager.streams()]

    def losses(self) -> str:
        """What the at-most-once datasets and streams lost, in one line (ShardManager.losses)."""
        with self._lock:
            return self.manager.losses()

    def all_progress(self) -> list[DatasetProgress]:
        """Every registered dataset's counters (metrics, dashboard)."""
        with self._lock:
            return [self.manager.dataset_progress(d) for d in self.manager.datasets()]

    # --- the master's own duties --------------------------------------------------------------
    def recover_node(self, node_id: str) -> int:
        """A node's workers are gone: their shards go back to the head of their queues."""
        with self._lock:
            count = self.manager.recover_node(node_id)
            if count:
                self._save()
            return count

    def tick(self) -> None:
        """Requeue the shards whose leases expired (save the state if any did); commit each
        stream's finished offsets to its broker (an asynchronous request: no wait here)."""
        with self._lock:
            if self.manager.tick():
                self._save()
        self._commit_offsets()

    def _commit_offsets(self) -> None:
        with self._lock:
            commits = [
                (source, self.manager.stream_committed(name))
                for name, source in self._sources.items()
            ]
        for source, offsets in commits:
            commit = getattr(source, "commit", None)
            if commit is not None:
                commit(offsets)

    def close(self) -> None:
        """Commit the streams' finished offsets a last time and close their broker
        connections."""
        self._commit_offsets()
        with self._lock:
            sources, self._sources = list(self._sources.values()), {}
        for source in sources:
            _close(source)

    @contextmanager
    def _changing(self, deferrable: bool = False) -> Iterator[None]:
        """Hold the lock for a call and save the state after it (``deferrable``: or leave the
        save to `flush`, inside `saves_deferred`); a refused call saves nothing."""
        with self._lock:
            yield
            deferred: Deferred | None = getattr(self._deferring, "current", None)
            if deferrable and deferred is not None:
                deferred.changed = True
                self._unsaved = True
            else:
                self._save()

    def _save(self) -> None:
        values: dict[str, Any] = {"state": self.manager.to_state(dataset_leases=False)}
        gone: list[str] = []
        for dataset, changes in self.manager.lease_changes().items():
            for (epoch, index), lease in changes.items():
                key = f"{_LEASE}{dataset}/{epoch}/{index}"
                if lease is None:
                    gone.append(key)
                else:
                    values[key] = lease
        self._store.put_json_many(_NAMESPACE, values, gone)
        # Only now: a write that failed leaves the changes to go with the next one.
        self.manager.lease_changes_saved()
        self._unsaved = False


def _attach_leases(state: dict[str, Any], store: StateStore) -> None:
    """Put the datasets' leases, kept one per key beside the state, back into the state's
    datasets (a state of the release before holds them in it already)."""
    held: dict[str, list[Any]] = {}
    for key, raw in store.items(_NAMESPACE).items():
        if key.startswith(_LEASE):
            dataset = key[len(_LEASE) :].rsplit("/", 2)[0]
            try:
                held.setdefault(dataset, []).append(json.loads(raw))
            except ValueError as e:
                raise StateStoreError(
                    f"the master's state {_NAMESPACE}/{key} in {store} is corrupt ({e}); it was "
                    "left as it is: restore the file from a backup, or start the job on a new "
                    "state"
                ) from None
    for entry in state.get("datasets", []):
        if "leases" not in entry:
            entry["leases"] = sorted(held.get(entry["spec"]["name"], []))
