"""The master's side of dynamic data sharding: typed calls onto one ShardManager, persisted."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from dlrover.master.state_store import StateStore
from dlrover.sharding.manager import ShardManager
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


class ShardingService:
    """Serialises calls onto the ShardManager and saves its state after every change.

    Its methods are those of ShardingTransport (dlrover/client/sharding_transport.py), each
    one RPC. The state is a few kilobytes (index ranges, not samples), so it is written whole
    after each call that changes what a restarted master must know; a restarted master
    rebuilds the manager from it and no registered dataset is reset. Lease renewals and
    consumption marks are not saved: leases get a fresh lease time on restore, and marks
    live in memory only (one per shard a worker starts).
    """

    def __init__(self, store: StateStore, clock: Callable[[], float]) -> None:
        self._store = store
        self._lock = threading.Lock()
        saved = store.get_json(_NAMESPACE, "state")
        self.manager = ShardManager.from_state(saved, clock) if saved else ShardManager(clock)

    # --- calls that change the saved state ----------------------------------------------------
    def register_dataset(self, spec: DatasetSpec) -> RegisterResult:
        """Register the dataset (ShardManager.register_dataset) and save the state."""
        with self._changing():
            return self.manager.register_dataset(spec)

    def fetch_shards(self, dataset: str, worker_id: str, max_count: int) -> FetchResult:
        """Lease shards to the worker (ShardManager.fetch_shards) and save the state."""
        with self._changing():
            return self.manager.fetch_shards(dataset, worker_id, max_count)

    def report_done(
        self, dataset: str, worker_id: str, shard_ids: Sequence[ShardId]
    ) -> ReportResult:
        """Mark shards done (ShardManager.report_done) and save the state."""
        with self._changing():
            return self.manager.report_done(dataset, worker_id, shard_ids)

    def report_progress(
        self, dataset: str, worker_id: str, shard_id: ShardId, consumed: int
    ) -> bool:
        """Record progress in a shard (ShardManager.report_progress) and save the state."""
        with self._changing():
            return self.manager.report_progress(dataset, worker_id, shard_id, consumed)

    def restore_position(self, position: Position, token: str | None) -> bool:
        """Reset the dataset to ``position``, once per ``token`` (ShardManager.restore_position),
        and save the state."""
        with self._changing():
            return self.manager.restore_position(position, token)

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
        """Requeue the shards whose leases expired; save the state if any did."""
        with self._lock:
            if self.manager.tick():
                self._save()

    @contextmanager
    def _changing(self) -> Iterator[None]:
        """Hold the lock for a call and save the state after it; a refused call saves nothing."""
        with self._lock:
            yield
            self._save()

    def _save(self) -> None:
        self._store.put_json(_NAMESPACE, "state", self.manager.to_state())
