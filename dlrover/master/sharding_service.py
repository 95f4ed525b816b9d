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
        with self._changing():
            return self.manager.register_dataset(spec)

    def fetch_shards(self, dataset: str, worker_id: str, max_count: int) -> FetchResult:
        with self._changing():
            return self.manager.fetch_shards(dataset, worker_id, max_count)

    def report_done(
        self, dataset: str, worker_id: str, shard_ids: Sequence[ShardId]
    ) -> ReportResult:
        with self._changing():
            return self.manager.report_done(dataset, worker_id, shard_ids)

    def report_progress(
        self, dataset: str, worker_id: str, shard_id: ShardId, consumed: int
    ) -> bool:
        with self._changing():
            return self.manager.report_progress(dataset, worker_id, shard_id, consumed)

    def restore_position(self, position: Position, token: str | None) -> bool:
        with self._changing():
            return self.manager.restore_position(position, token)

    # --- calls that do not --------------------------------------------------------------------
    def renew_leases(self, dataset: str, worker_id: str) -> int:
        with self._lock:
            return self.manager.renew_leases(dataset, worker_id)

    def get_position(self, dataset: str) -> Position:
        with self._lock:
            return self.manager.get_position(dataset)

    def mark_consumption(self, dataset: str, worker_id: str, mark: ConsumptionMark) -> None:
        with self._lock:
            self.manager.mark_consumption(dataset, worker_id, mark)

    def position_at(self, dataset: str, epoch: int, consumed: int) -> PositionAt:
        with self._lock:
            return self.manager.position_at(dataset, epoch, consumed)

    def dataset_progress(self, dataset: str) -> DatasetProgress:
        with self._lock:
            return self.manager.dataset_progress(dataset)

    # --- the master's own duties --------------------------------------------------------------
    def recover_node(self, node_id: str) -> int:
        """A node's workers are gone: their shards go back to the head of their queues."""
        with self._lock:
            count = self.manager.recover_node(node_id)
            if count:
                self._save()
            return count

    def tick(self) -> None:
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
