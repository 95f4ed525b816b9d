"""The messages between the agent's `Zygote` and the zygote process, shared by both ends.

One JSON object per line on the inherited unix socket (codec: `dlrover.json_messages`), no
pickle; a spawn's output descriptors ride with its line (SCM_RIGHTS). Agent -> zygote: requests
named by ``"op"``; zygote -> agent: events named by ``"event"``. Only the standard library is
imported: the zygote reads this before its preload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from dlrover.json_messages import decode_tagged, encode, parse


@dataclass(frozen=True)
class ZygoteRequest:
    """Base of what the agent asks the zygote; ``op`` names the request on the wire."""

    op: ClassVar[str]


@dataclass(frozen=True)
class SpawnRequest(ZygoteRequest):
    """Fork a worker and make it what ``python argv...`` in ``cwd`` would have been.

    ``argv`` is ``[script, args...]`` or ``["-m", module, args...]``; ``env`` is the worker's
    complete environment (it replaces the zygote's). The worker's stdout and stderr are not
    named here: the agent sends the two open descriptors (OUTPUT_FDS) in the same ``sendmsg``
    as the line, which it prefixes with FDS_MARKER, so the worker writes through the agent's own open files (the same offset and
    O_APPEND, as a Popen child inheriting them would). ``unbuffered`` is ``python -u``: both
    streams write through at once. The zygote answers `SpawnedEvent` or `SpawnFailedEvent` with
    the same ``request_id``.
    """

    op: ClassVar[str] = "spawn"
    request_id: int
    argv: list[str]
    env: dict[str, str]
    cwd: str
    unbuffered: bool


OUTPUT_FDS = 2
"""Descriptors sent with each `SpawnRequest` line: the worker's stdout, then its stderr."""

FDS_MARKER = b"\x00"
"""Prefix of a line sent together with descriptors (one ``sendmsg``); never part of JSON text."""


@dataclass(frozen=True)
class ExitRequest(ZygoteRequest):
    """Kill the remaining workers and exit."""

    op: ClassVar[str] = "exit"


@dataclass(frozen=True)
class WarmRequest(ZygoteRequest):
    """Import inductor's compiler and ask its probes of the machine, so that workers forked
    afterwards start with them (`dlrover.agent.compiler_warmup`). Answered by `WarmedEvent`;
    spawns sent meanwhile wait for it."""

    op: ClassVar[str] = "warm"


@dataclass(frozen=True)
class ZygoteEvent:
    """Base of what the zygote reports; ``event`` names it on the wire."""

    event: ClassVar[str]


@dataclass(frozen=True)
class ReadyEvent(ZygoteEvent):
    """The preload is done (the first line the zygote writes); the zygote serves requests."""

    event: ClassVar[str] = "ready"
    pid: int
    preload_s: float  # seconds spent importing the preloaded modules
    threads: int  # native threads after the preload (-1: unknown)


@dataclass(frozen=True)
class SpawnedEvent(ZygoteEvent):
    """The worker of spawn ``request_id`` was forked as ``pid``."""

    event: ClassVar[str] = "spawned"
    request_id: int
    pid: int


@dataclass(frozen=True)
class SpawnFailedEvent(ZygoteEvent):
    """The zygote did not fork spawn ``request_id``; ``error`` says why."""

    event: ClassVar[str] = "spawn_failed"
    request_id: int
    error: str


@dataclass(frozen=True)
class ExitedEvent(ZygoteEvent):
    """Worker ``pid`` exited and was reaped; Popen's convention (-N: killed by signal N)."""

    event: ClassVar[str] = "exited"
    pid: int
    returncode: int


@dataclass(frozen=True)
class ErrorEvent(ZygoteEvent):
    """A request line the zygote could not read (not JSON, unknown op, a bad field)."""

    event: ClassVar[str] = "error"
    error: str


@dataclass(frozen=True)
class WarmedEvent(ZygoteEvent):
    """The answer to `WarmRequest`: its seconds, the probes skipped, or why it failed."""

    event: ClassVar[str] = "warmed"
    seconds: float
    skipped: list[str]
    error: str


REQUEST_TYPES: tuple[type[ZygoteRequest], ...] = (SpawnRequest, ExitRequest, WarmRequest)
EVENT_TYPES: tuple[type[ZygoteEvent], ...] = (
    ReadyEvent,
    SpawnedEvent,
    SpawnFailedEvent,
    ExitedEvent,
    ErrorEvent,
    WarmedEvent,
)
_REQUESTS_BY_OP = {request.op: request for request in REQUEST_TYPES}
_EVENTS_BY_NAME = {event.event: event for event in EVENT_TYPES}


def encode_request(request: ZygoteRequest) -> bytes:
    """One JSON line of ``request``, tagged with its ``op``."""
    return encode(request, op=request.op)


def decode_request(line: bytes) -> ZygoteRequest:
    """The request on ``line``; MessageError if it is not a well-formed one."""
    return decode_tagged(parse(line, "zygote request"), "op", _REQUESTS_BY_OP, "zygote request")


def encode_event(event: ZygoteEvent) -> bytes:
    """One JSON line of ``event``, tagged with its kind."""
    return encode(event, event=event.event)


def decode_event(line: bytes) -> ZygoteEvent:
    """The event on ``line``; MessageError if it is not a well-formed one."""
    return decode_tagged(parse(line, "zygote event"), "event", _EVENTS_BY_NAME, "zygote event")
