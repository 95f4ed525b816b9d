"""Dynamic data sharding: the master leases index-range shards, the client prefetches them."""

from dlrover.sharding.client import ShardingClient
from dlrover.sharding.errors import (
    DatasetConflictError,
    InvalidPositionError,
    InvalidSpecError,
    ShardingError,
    ShardingTimeoutError,
    ShardRetriesExhaustedError,
    UnknownDatasetError,
)
from dlrover.sharding.manager import ShardManager
from dlrover.sharding.stream import InMemoryStreamSource, StreamShard, StreamSource, StreamSpec
from dlrover.sharding.transport import InProcessTransport, ShardingTransport
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
    "InProcessTransport",
    "InvalidPositionError",
    "InvalidSpecError",
    "Position",
    "RegisterResult",
    "ReportResult",
    "Shard",
    "ShardId",
    "ShardManager",
    "ShardRetriesExhaustedError",
    "ShardingClient",
    "ShardingError",
    "ShardingTimeoutError",
    "ShardingTransport",
    "StreamShard",
    "StreamSource",
    "StreamSpec",
    "UnknownDatasetError",
]
