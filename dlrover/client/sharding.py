"""The gRPC ShardingTransport: each ShardingTransport method is the master's RPC of that name."""

from __future__ import annotations

import os
import time
from typing import Any

from dlrover.api.retry import while_unreachable
from dlrover.api.rpc import Rpc, derive_client
from dlrover.api.sharding import ShardingTransport, StreamTransport
from dlrover.api.wire import RPCS
from dlrover.client.master_client import MasterClient
from dlrover.constants import DEFAULT_MASTER_RECONNECT_S, ENV_JOB_TOKEN

_ShardingRpcs: Any = derive_client(
    "_ShardingRpcs",
    {m: c for m, c in RPCS.items() if c.interface in (ShardingTransport, StreamTransport)},
)
"""A method per sharding RPC, made from the interfaces (typed by them, see MasterClient)."""


class GrpcShardingTransport(_ShardingRpcs, ShardingTransport, StreamTransport):
    """Reaches the master's ShardManager over the wire; thread-safe (gRPC channels are). Its
    methods are derived from the interfaces (`dlrover.api.rpc`).

    A sharding refusal raises its own class from dlrover.sharding.errors; a request the
    master finds malformed raises MasterRequestError. A master that does not answer (it is
    being restarted on its state) is called again for up to ``reconnect_s`` seconds, then
    MasterUnreachableError is raised (see MasterClient): every sharding call may be sent
    twice (marks, reports and restores are idempotent; a lease whose answer was lost expires).
    """

    def __init__(
        self, client: MasterClient, reconnect_s: float = DEFAULT_MASTER_RECONNECT_S
    ) -> None:
        self._client = client
        self._reconnect_s = reconnect_s

    def invoke(self, call: Rpc, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One sharding RPC through the master client (see MasterClient.invoke), riding out a
        master restart."""
        return while_unreachable(
            lambda: self._client.invoke(call, args, kwargs),
            time.monotonic() + self._reconnect_s,
            f"sharding call {call.name}",
        )


def connect(
    master_addr: str, token: str | None = None, reconnect_s: float = DEFAULT_MASTER_RECONNECT_S
) -> GrpcShardingTransport:
    """A transport to the master at `master_addr` (token: argument or $DLROVER_JOB_TOKEN) that
    waits up to ``reconnect_s`` for a master that does not answer."""
    token = os.environ.get(ENV_JOB_TOKEN, "") if token is None else token
    return GrpcShardingTransport(MasterClient(master_addr, token), reconnect_s)
