"""Dynamic data sharding, shared by both sides: types, errors and the master's pure policy.

The trainer-side client lives in dlrover.client (ShardingClient, ShardingTransport, the gRPC
transport); an in-process transport for tests in dlrover.testing.sharding."""

from dlrover.sharding.errors import (
    DatasetConflictError,
    InvalidPositionError,
    InvalidSpecError,
    ShardingError,
    ShardingTimeoutError,
    ShardRetriesExhaustedError,
    StreamSourceError,
    UnknownDatasetError,
)
from dlrover.sharding.manager import ShardManager
from dlrover.sharding.stream import (
    InMemoryStreamSource,
    StreamPosition,
    StreamShard,
    StreamSource,
    StreamSpec,
)
from dlrover.sharding.types import (
    DatasetProgress,
    DatasetSpec,
    DeliveryMode,
    FetchResult,
    Position,
    RegisterResult,
    ReportResult,
    Shard,
    ShardId,
)

__all__ = [
    "DatasetConflictError",
    "DatasetProgress",
    "DatasetSpec",
    "DeliveryMode",
    "FetchResult",
    "InMemoryStreamSource",
    "InvalidPositionError",
    "InvalidSpecError",
    "Position",
    "RegisterResult",
    "ReportResult",
    "Shard",
    "ShardId",
    "ShardManager",
    "ShardRetriesExhaustedError",
    "ShardingError",
    "ShardingTimeoutError",
    "StreamPosition",
    "StreamShard",
    "StreamSource",
    "StreamSourceError",
    "StreamSpec",
    "UnknownDatasetError",
]
