"""The wire client to the job master."""

from dlrover.client.master_client import (
    MasterClient,
    MasterClientError,
    MasterRequestError,
    MasterUnreachableError,
    WrongTokenError,
)
from dlrover.client.stream_client import StreamShardingClient

__all__ = [
    "MasterClient",
    "MasterClientError",
    "MasterRequestError",
    "MasterUnreachableError",
    "StreamShardingClient",
    "WrongTokenError",
]
