"""The channel between an agent and its workers that recover in-process, shared by both ends.

A worker whose training function is wrapped (`dlrover.trainer.torch.inprocess.Wrapper`)
connects to its agent's unix socket (``DLROVER_RECOVERY_SOCKET``) and says `Hello`: from then on
a peer's failure does not cost this process. The agent answers a failure or a membership change
with `Abort` (stop at once: the current step is lost), the worker releases its collectives and
says `Parked`, and once the world has re-formed the agent sends `NewRound`: the environment
variables of the new round (ranks, store, round, restart count) that changed. The worker
applies them and calls its training function again, in the same process.

One JSON object per line (codec: `dlrover.json_messages`), no pickle. Agent -> worker:
``"kind"`` names the message; worker -> agent the same. Only the standard library is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dlrover.json_messages import decode_tagged, encode, parse


@dataclass(frozen=True)
class WorkerMessage:
    """Base of what a worker tells its agent; ``kind`` names it on the wire."""

    kind: ClassVar[str]


@dataclass(frozen=True)
class Hello(WorkerMessage):
    """The worker at ``local_rank`` (process ``pid``) recovers in-process: on a failure elsewhere
    the agent keeps it running and sends it the next round instead of restarting it.

    ``shrink``: after a local rank fails, this worker goes on at once in a world without it
    (standing in for its data, `DLROVER_VIRTUAL_RANKS`) instead of waiting for its replacement.
    A replacement started to join later (``DLROVER_RECOVERY_JOIN``) says Hello once it is ready
    (its model built and warmed up) and waits for `NewRound` before its first entry."""

    kind: ClassVar[str] = "hello"
    local_rank: int
    pid: int
    shrink: bool = False


@dataclass(frozen=True)
class Parked(WorkerMessage):
    """The worker left its training function (``error``: why, e.g. a peer closed its collective),
    destroyed its process groups and waits for `NewRound`; its state stays in memory."""

    kind: ClassVar[str] = "parked"
    local_rank: int
    error: str


@dataclass(frozen=True)
class AgentMessage:
    """Base of what an agent tells a worker; ``kind`` names it on the wire."""

    kind: ClassVar[str]


@dataclass(frozen=True)
class Abort(AgentMessage):
    """Leave the training function now (``reason``: what happened); then say `Parked`."""

    kind: ClassVar[str] = "abort"
    reason: str
    at_step_end: bool = False
    """Leave at the end of the current step (the script's next `StepReporter.report`), or
    within a few seconds at most, so that no work is lost (a replacement joins)."""


@dataclass(frozen=True)
class NewRound(AgentMessage):
    """The world re-formed as rendezvous round ``round``: set ``env`` (the worker environment's
    variables that changed; an empty value removes one) and call the training function again."""

    kind: ClassVar[str] = "round"
    round: int
    env: dict[str, str]


_WORKER = {m.kind: m for m in (Hello, Parked)}
_AGENT = {m.kind: m for m in (Abort, NewRound)}


def encode_message(message: WorkerMessage | AgentMessage) -> bytes:
    """One JSON line of ``message``, tagged with its kind."""
    return encode(message, kind=message.kind)


def decode_worker_message(line: bytes) -> WorkerMessage:
    """What a worker sent on ``line``; MessageError if it is not a well-formed message."""
    return decode_tagged(parse(line, "worker message"), "kind", _WORKER, "worker message")


def decode_agent_message(line: bytes) -> AgentMessage:
    """What the agent sent on ``line``; MessageError if it is not a well-formed message."""
    return decode_tagged(parse(line, "agent message"), "kind", _AGENT, "agent message")


def env_changes(before: dict[str, str], after: dict[str, str]) -> dict[str, str]:
    """The variables to set so that an environment equal to ``before`` equals ``after`` (a
    removed one as ""): what `NewRound` carries."""
    changed = {k: v for k, v in after.items() if before.get(k) != v}
    changed.update({k: "" for k in before if k not in after})
    return changed
