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

    def register_dataset(self, spec: DatasetSpec) -> RegisterResult: ...

    def fetch_shards(self, dataset: str, worker_id: str, max_count: int) -> FetchResult: ...

    def report_done(
        self, dataset: str, worker_id: str, shard_ids: Sequence[ShardId]
    ) -> ReportResult: ...

    def report_progress(
        self, dataset: str, worker_id: str, shard_id: ShardId, consumed: int
    ) -> bool: ...

    def renew_leases(self, dataset: str, worker_id: str) -> int: ...

    def get_position(self, dataset: str) -> Position: ...

    def mark_consumption(self, dataset: str, worker_id: str, mark: ConsumptionMark) -> None: ...

    def position_at(self, dataset: str, epoch: int, consumed: int) -> PositionAt: ...

    def restore_position(self, position: Position, token: str | None) -> bool: ...

    def dataset_progress(self, dataset: str) -> DatasetProgress: ...
