"""The gRPC ShardingTransport: each ShardingTransport method is the master's RPC of that name."""

from __future__ import annotations

import os
from typing import Any

from dlrover.api.rpc import Rpc, derive_client
from dlrover.api.sharding import ShardingTransport, StreamTransport
from dlrover.api.wire import RPCS
from dlrover.client.master_client import MasterClient
from dlrover.constants import ENV_JOB_TOKEN

_ShardingRpcs: Any = derive_client(
    "_ShardingRpcs",
    {m: c for m, c in RPCS.items() if c.interface in (ShardingTransport, StreamTransport)},
)
"""A method per sharding RPC, made from the interfaces (typed by them, see MasterClient)."""


class GrpcShardingTransport(_ShardingRpcs, ShardingTransport, StreamTransport):
    """Reaches the master's ShardManager over the wire; thread-safe (gRPC channels are). Its
    methods are derived from the interfaces (`dlrover.api.rpc`).

    A sharding refusal raises its own class from dlrover.sharding.errors; a request the
    master finds malformed raises MasterRequestError, an unreachable master
    MasterUnreachableError (see MasterClient).
    """

    def __init__(self, client: MasterClient) -> None:
        self._client = client

    def invoke(self, call: Rpc, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One sharding RPC through the master client (see MasterClient.invoke)."""
        return self._client.invoke(call, args, kwargs)


def connect(master_addr: str, token: str | None = None) -> GrpcShardingTransport:
    """A transport to the master at `master_addr` (token: argument or $DLROVER_JOB_TOKEN)."""
    token = os.environ.get(ENV_JOB_TOKEN, "") if token is None else token
    return GrpcShardingTransport(MasterClient(master_addr, token))
