"""The one place where a part's error becomes the API's refusal.

A part of the master serves its calls in domain types and raises its own errors (`NodeError`,
`RendezvousError`, `KvError`, a `ValueError` for a bad argument). Whoever runs the call, the gRPC
servicer or the in-process `LocalMasterApi`, turns what it raised into the error the caller sees
through `as_refusal`: `UnknownNodeError` for a node the master does not know (the agent registers
again), `MasterRequestError` for any other refusal. Anything else is a bug and is raised as is.
"""

from __future__ import annotations

from dlrover.api.errors import MasterRequestError, UnknownNodeError
from dlrover.master.kv_store import KvError
from dlrover.master.nodes import NodeError
from dlrover.master.nodes import UnknownNodeError as UnknownNode
from dlrover.master.rendezvous import RendezvousError

__all__ = ["as_refusal"]


def as_refusal(error: Exception) -> MasterRequestError | None:
    """The API error for a refused call, or None when ``error`` is not a refusal."""
    if isinstance(error, MasterRequestError):
        return error
    if isinstance(error, UnknownNode):
        return UnknownNodeError(str(error))
    if isinstance(error, (NodeError, RendezvousError, KvError, ValueError)):
        return MasterRequestError(str(error))
    return None
