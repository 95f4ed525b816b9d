"""The wire client to the job master."""

from dlrover.client.master_client import (
    MasterClient,
    MasterClientError,
    MasterRequestError,
    MasterUnreachableError,
    WrongTokenError,
)

__all__ = [
    "MasterClient",
    "MasterClientError",
    "MasterRequestError",
    "MasterUnreachableError",
    "WrongTokenError",
]
