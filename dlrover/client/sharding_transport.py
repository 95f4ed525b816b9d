"""The client-to-master calls of sharding, one method per RPC (gRPC: dlrover.client.sharding)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

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


class ShardingTransport(Protocol):
    """How a ShardingClient reaches the master. Each method is one RPC of the same name.

    Every argument and result is a dataclass of dlrover.sharding.types; the gRPC transport
    sends each as the protobuf message of the same name (dlrover/sharding/wire.py), and a
    refusal raises its class from dlrover.sharding.errors. Implementations must be safe to
    call from several threads (the client's prefetcher and the training loop).
    """

    def register_dataset(self, spec: DatasetSpec) -> RegisterResult:
        """Register ``spec``: a no-op if the same spec exists, DatasetConflictError if a different
        one does."""
        ...

    def fetch_shards(self, dataset: str, worker_id: str, max_count: int) -> FetchResult:
        """Lease up to ``max_count`` shards of ``dataset`` to ``worker_id``; none and not finished
        means the rest is leased to others (ask again)."""
        ...

    def report_done(
        self, dataset: str, worker_id: str, shard_ids: Sequence[ShardId]
    ) -> ReportResult:
        """Report shards ``worker_id`` finished; counts those accepted and those that named no open
        shard."""
        ...

    def report_progress(
        self, dataset: str, worker_id: str, shard_id: ShardId, consumed: int
    ) -> bool:
        """Report that the first ``consumed`` samples (shard order) of ``shard_id`` are trained,
        renewing its lease; False if the worker no longer holds it."""
        ...

    def renew_leases(self, dataset: str, worker_id: str) -> int:
        """Extend every lease ``worker_id`` holds on ``dataset``; returns how many."""
        ...

    def get_position(self, dataset: str) -> Position:
        """The dataset's consumed position now (shards in flight are pending), to save with a
        checkpoint."""
        ...

    def mark_consumption(self, dataset: str, worker_id: str, mark: ConsumptionMark) -> None:
        """Record where ``worker_id`` stands in its iteration (see ConsumptionMark)."""
        ...

    def position_at(self, dataset: str, epoch: int, consumed: int) -> PositionAt:
        """The position once every worker had consumed ``consumed`` samples of iteration ``epoch``,
        or the workers it still waits for."""
        ...

    def restore_position(self, position: Position, token: str | None) -> bool:
        """Reset the dataset to ``position``; False when ``token`` is the one applied last (a no-op,
        so every rank may restore the same checkpoint)."""
        ...

    def dataset_progress(self, dataset: str) -> DatasetProgress:
        """The dataset's progress counters."""
        ...
