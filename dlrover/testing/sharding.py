"""A ShardingTransport that calls a ShardManager in this process: tests, benchmarks, examples."""

from __future__ import annotations

import threading
from collections.abc import Sequence

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


class InProcessTransport:
    """Calls a ShardManager in this process under a lock: for tests, benchmarks, standalone."""

    def __init__(self, manager: ShardManager) -> None:
        self.manager = manager
        self._lock = threading.Lock()

    def register_dataset(self, spec: DatasetSpec) -> RegisterResult:
        """Register ``spec`` (ShardManager.register_dataset), under the lock."""
        with self._lock:
            return self.manager.register_dataset(spec)

    def fetch_shards(self, dataset: str, worker_id: str, max_count: int) -> FetchResult:
        """Lease shards to ``worker_id`` (ShardManager.fetch_shards), under the lock."""
        with self._lock:
            return self.manager.fetch_shards(dataset, worker_id, max_count)

    def report_done(
        self, dataset: str, worker_id: str, shard_ids: Sequence[ShardId]
    ) -> ReportResult:
        """Mark shards done (ShardManager.report_done), under the lock."""
        with self._lock:
            return self.manager.report_done(dataset, worker_id, shard_ids)

    def report_progress(
        self, dataset: str, worker_id: str, shard_id: ShardId, consumed: int
    ) -> bool:
        """Record progress in a shard (ShardManager.report_progress), under the lock."""
        with self._lock:
            return self.manager.report_progress(dataset, worker_id, shard_id, consumed)

    def renew_leases(self, dataset: str, worker_id: str) -> int:
        """Extend ``worker_id``'s leases (ShardManager.renew_leases), under the lock."""
        with self._lock:
            return self.manager.renew_leases(dataset, worker_id)

    def get_position(self, dataset: str) -> Position:
        """The dataset's consumed position (ShardManager.get_position), under the lock."""
        with self._lock:
            return self.manager.get_position(dataset)

    def mark_consumption(self, dataset: str, worker_id: str, mark: ConsumptionMark) -> None:
        """Record a consumption mark (ShardManager.mark_consumption), under the lock."""
        with self._lock:
            self.manager.mark_consumption(dataset, worker_id, mark)

    def position_at(self, dataset: str, epoch: int, consumed: int) -> PositionAt:
        """The position at a step of every worker (ShardManager.position_at), under the lock."""
        with self._lock:
            return self.manager.position_at(dataset, epoch, consumed)

    def restore_position(self, position: Position, token: str | None) -> bool:
        """Reset the dataset to ``position`` once per ``token`` (ShardManager.restore_position),
        under the lock."""
        with self._lock:
            return self.manager.restore_position(position, token)

    def dataset_progress(self, dataset: str) -> DatasetProgress:
        """The dataset's counters (ShardManager.dataset_progress), under the lock."""
        with self._lock:
            return self.manager.dataset_progress(dataset)

    # Master-side duties a test drives directly (the real master calls the manager itself).
    def recover_worker(self, worker_id: str) -> int:
        """Return every shard ``worker_id`` holds to its queue head, as the master does for a lost
        worker; returns how many."""
        with self._lock:
            return self.manager.recover_worker(worker_id)

    def tick(self, now: float | None = None) -> int:
        """Requeue the shards whose leases expired at ``now`` (default: the manager's clock), as the
        master's tick does; returns how many."""
        with self._lock:
            return self.manager.tick(now)
