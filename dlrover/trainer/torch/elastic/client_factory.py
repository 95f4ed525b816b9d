"""How the elastic sampler finds its sharding client: an argument, or the master in the env."""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
from typing import Any

from dlrover import worker_context
from dlrover.client.sharding_transport import ShardingTransport
from dlrover.constants import ENV_DELIVERY_MODE, ENV_MASTER_ADDR, ENV_NODE_ID
from dlrover.sharding.config import ENV_SHARD_LEASE_S, ENV_SHARD_PREFETCH, ShardingEnv
from dlrover.sharding.errors import InvalidSpecError, ShardingError
from dlrover.sharding.types import DeliveryMode

logger = logging.getLogger(__name__)


class NoMasterError(ShardingError):
    """A reader of dynamic shards found no job master to lease them from (trainer side only)."""


GRPC_TRANSPORT_MODULE = "dlrover.client.sharding"
"""Module that provides the gRPC transport; it must define `connect(master_addr) -> transport`."""


def transport_from_env() -> ShardingTransport | None:
    """A transport to the master in DLROVER_MASTER_ADDR, or None when no master is configured.

    Raises NoMasterError when the address is set but the wire transport module cannot be
    imported (a broken install: nothing can reach the master).
    """
    address = os.environ.get(ENV_MASTER_ADDR, "")
    if not address:
        return None
    try:
        module = importlib.import_module(GRPC_TRANSPORT_MODULE)
    except ImportError as error:
        raise NoMasterError(
            f"{ENV_MASTER_ADDR}={address} is set but {GRPC_TRANSPORT_MODULE} cannot be imported "
            f"({error}); reinstall dlrover with its gRPC dependencies"
        ) from error
    transport: ShardingTransport = module.connect(address)
    return transport


def default_worker_id(rank: int) -> str:
    """`<node_id>/<local_rank>`: the master recovers all of a node's workers by its id."""
    env = os.environ
    local_rank = env.get(worker_context.LOCAL_RANK, "") or str(rank)
    return f"{env.get(ENV_NODE_ID, 'local')}/{local_rank}"


def prefetch_from_env() -> int:
    """Shards a sharding client keeps leased ahead: DLROVER_SHARD_PREFETCH, else
    DEFAULT_PREFETCH_SHARDS; ValueError for a value that is not an integer."""
    return ShardingEnv.from_env(_only(ENV_SHARD_PREFETCH)).prefetch


def lease_s_from_env() -> float:
    """Lease time in seconds of datasets the sampler registers: DLROVER_SHARD_LEASE_S, else
    DEFAULT_LEASE_S; ValueError for a value that is not a number."""
    return ShardingEnv.from_env(_only(ENV_SHARD_LEASE_S)).lease_s


def delivery_mode(
    given: DeliveryMode | str | None, default: DeliveryMode = DeliveryMode.EXACTLY_ONCE
) -> DeliveryMode:
    """The delivery mode a reader uses: the one its code gives, else DLROVER_DELIVERY_MODE (a
    job spec's ``delivery_mode``), else ``default``. InvalidSpecError for an unknown name."""
    source = "mode="
    if given is None:
        given, source = os.environ.get(ENV_DELIVERY_MODE, "") or default, ENV_DELIVERY_MODE
    try:
        return DeliveryMode(given)
    except ValueError:
        names = ", ".join(m.value for m in DeliveryMode)
        raise InvalidSpecError(
            f"{source} {given!r} is not a delivery mode; use one of {names}"
        ) from None


def _only(name: str) -> dict[str, str]:
    # One field read alone: a malformed other variable must not fail a caller that needs only
    # this one (the sampler given its prefetch reads only the lease).
    return {name: os.environ.get(name, "")}


def restore_token(position: dict[str, Any]) -> str:
    """Names one restore of ``position`` in this start of the workers (see attempt_id): every
    rank restoring the same checkpoint sends the same token, so the master applies it once."""
    digest = hashlib.sha256(json.dumps(position, sort_keys=True).encode()).hexdigest()
    return f"{digest[:16]}@{attempt_id()}"


def attempt_id() -> str:
    """Names one start of the job's workers alike on every rank: ``round-<n>``, the rendezvous
    round they started in (every start under dlrover-run is a new round); without one (no
    dlrover agent) ``restart-<n>``, the restart count.

    Not the restart count under an agent: it is each node's own (the node whose worker failed
    counts a restart, the others only re-form; a replacement node starts at 0), so ranks of one
    start would name it differently, and each would apply the checkpoint's position again after
    others had leased shards under it."""
    ctx = worker_context.WorkerContext.from_env()
    if ctx.rdzv_round > 0:
        return f"round-{ctx.rdzv_round}"
    return f"restart-{ctx.restart_count}"
