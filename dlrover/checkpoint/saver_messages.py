"""The messages on the checkpoint saver's socket, shared by `SaverClient` and `CheckpointSaver`.

One JSON object per line each way (codec: `dlrover.json_messages`). A request names its
operation in ``"op"``. The saver answers every request with one line: ``{"ok": true, ...}``
holding the fields of the request's reply type, or a refusal ``{"ok": false, "error": ...}``
(with ``"kind": "ShmSpaceError", "path", "needed", "free"`` when /dev/shm is too small),
which the client raises as `SaverError` (or `ShmSpaceError`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Literal, TypeVar

from dlrover.checkpoint.config import DEFAULT_COPY_WAIT_S
from dlrover.json_messages import MessageError, decode_tagged, encode, from_fields, parse


@dataclass(frozen=True)
class PersistSpec:
    """What a persist of one step writes, as sent by the saving workers of this node."""

    checkpoint_dir: str
    slots: dict[int, int]  # local slot -> global rank whose part it is
    # rank_<r>.bin + meta, torch.distributed.checkpoint files, or a framework's torch.save files
    fmt: Literal["plain", "dcp", "deepspeed", "megatron", "megatron_torch_dist"]
    node_rank: int
    persist_nodes: int  # how many nodes write parts of a step; the commit waits for all
    keep_last: int
    persists: bool = True  # False on nodes that only keep a memory copy (DDP, node rank > 0)
    replicas: int = 0  # push each copy to this many next nodes of the ring (sharded state)
    num_nodes: int = 1  # nodes in the job (the ring the replicas go around)
    round_id: int = 0  # the rendezvous round the copy was made in (peers' addresses are per round)


MAX_WAIT_S = 86_400.0
"""The longest wait a request may ask the saver for (a day; the defaults are minutes)."""


@dataclass(frozen=True)
class SaverReply:
    """Base of the saver's answers."""


ReplyT = TypeVar("ReplyT", bound=SaverReply)


@dataclass(frozen=True)
class SaverRequest(ABC, Generic[ReplyT]):
    """Base of the requests a worker sends; ``op`` names the request on the wire."""

    op: ClassVar[str]

    @property
    @abstractmethod
    def reply_type(self) -> type[ReplyT]:
        """What the saver answers unless it refuses."""

    def answer_within_s(self) -> float | None:
        """How long the saver may wait before it answers; None: it answers at once."""
        return None

    def __post_init__(self) -> None:
        wait = self.answer_within_s()
        # `not <=` also catches NaN, which passes every bound and made a wait endless, and
        # infinity, which the saver's condition waits cannot take (OverflowError).
        if wait is not None and not wait <= MAX_WAIT_S:
            raise MessageError(
                f"saver request {self.op!r}: a wait of {wait} s; at most {MAX_WAIT_S:.0f} s"
            )


# ---------------------------------------------------------------------------- replies
@dataclass(frozen=True)
class AllocateReply(SaverReply):
    """The slot's shared segment: its path and size (at least the bytes asked for)."""

    path: str
    nbytes: int


@dataclass(frozen=True)
class AttachReply(SaverReply):
    """The slot's shared segment; None if the saver holds none for it. With no segment and a
    ``peer_addr``: the step was voted from that peer's memory and the rank (which asked
    ``direct``) receives it from there itself: image ``key`` holding ``step``, asked for with
    the job's ``token``."""

    path: str | None
    peer_addr: str = ""
    key: str = ""
    step: int | None = None
    token: str = ""


@dataclass(frozen=True)
class BeginCopyReply(SaverReply):
    """The buffer to copy into now (``path``, ``nbytes`` long) and how long the saver waited
    for it to be free (0 unless a persist or push of the slot had to end first)."""

    path: str
    nbytes: int
    waited_s: float = 0.0


@dataclass(frozen=True)
class CopiedReply(SaverReply):
    """The copy is recorded (and its persist queued, if one was asked for)."""


@dataclass(frozen=True)
class HeldReply(SaverReply):
    """The complete step in each slot's segment (None: empty or torn)."""

    steps: dict[int, int | None]


@dataclass(frozen=True)
class LoadStepReply(SaverReply):
    """The step every node agreed to load from memory; None: load from storage. ``peer``: the
    node whose memory this node copied the step from (it had lost its own), else None."""

    step: int | None
    peer: int | None = None


@dataclass(frozen=True)
class WaitPersistedReply(SaverReply):
    """``persisted``: the step (or a newer one) is committed; else ``failure`` says why, or
    the wait timed out (``failure`` None)."""

    persisted: bool
    committed: int | None  # newest step committed to the directory, if any
    failure: str | None


@dataclass(frozen=True)
class Refused(SaverReply):
    """The saver could not serve the request; ``error`` is ``"<ExceptionType>: <message>"``."""

    error: str


@dataclass(frozen=True)
class ShmSpaceRefused(Refused):
    """/dev/shm has too little free space for the segment asked for."""

    path: str
    needed: int
    free: int


# ---------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class AllocateRequest(SaverRequest[AllocateReply]):
    """Create the shared segment of ``slot``, or grow it, to hold ``nbytes``."""

    op: ClassVar[str] = "allocate"
    reply_type: ClassVar[type[AllocateReply]] = AllocateReply
    slot: int
    nbytes: int


@dataclass(frozen=True)
class AttachRequest(SaverRequest[AttachReply]):
    """Which buffer of ``slot`` holds ``step`` (None: its newest complete copy), for loading
    from memory. A step the vote found in a peer's memory only: with ``direct`` (the rank
    alone reads the slot) the answer says where, and the rank receives it straight into its
    tensors; without, the saver first copies it into the slot (within ``timeout``)."""

    op: ClassVar[str] = "attach"
    reply_type: ClassVar[type[AttachReply]] = AttachReply
    slot: int
    step: int | None = None
    direct: bool = False
    timeout: float = 60.0

    def answer_within_s(self) -> float | None:
        """The saver may copy the step from a peer, up to ``timeout``, before it answers."""
        return self.timeout


@dataclass(frozen=True)
class BeginCopyRequest(SaverRequest[BeginCopyReply]):
    """Which buffer of ``slot`` does the copy of ``step`` (``nbytes``) go into? The saver
    creates or grows it and picks one that no persist or push reads (``buffers.choose_buffer``):
    a memory-only copy gets one at once; one that asks for a ``persist`` waits, up to
    ``timeout`` seconds, until the slot's previous persist or push is done. Refused (an error
    naming the cause) if no buffer is free by then or /dev/shm is too small."""

    op: ClassVar[str] = "begin_copy"
    reply_type: ClassVar[type[BeginCopyReply]] = BeginCopyReply
    slot: int
    nbytes: int
    step: int
    persist: bool = False
    timeout: float = DEFAULT_COPY_WAIT_S

    def answer_within_s(self) -> float | None:
        """The saver may wait up to ``timeout`` before it answers."""
        return self.timeout


@dataclass(frozen=True)
class CopiedRequest(SaverRequest[CopiedReply]):
    """``slot`` now holds ``step``; with ``persist`` (and a ``spec``) write it to storage."""

    op: ClassVar[str] = "copied"
    reply_type: ClassVar[type[CopiedReply]] = CopiedReply
    slot: int
    step: int
    spec: PersistSpec | None = None
    persist: bool = False


@dataclass(frozen=True)
class HeldRequest(SaverRequest[HeldReply]):
    """The complete step in every slot."""

    op: ClassVar[str] = "held"
    reply_type: ClassVar[type[HeldReply]] = HeldReply


@dataclass(frozen=True)
class LoadStepRequest(SaverRequest[LoadStepReply]):
    """Vote the step complete in all of ``slots`` (saved by ``ranks[slot]`` at ``world_size``
    when given) and agree with the other nodes on the step to load in restart round
    ``round_id``; the first request of a round votes, the others get the same answer. With
    ``replica_count``, a node whose memory lacks the step votes the newest step a peer's
    memory holds for all its slots (images of ``checkpoint_dir``, when given); it is copied
    only when a rank loads it (``AttachRequest``)."""

    op: ClassVar[str] = "load_step"
    reply_type: ClassVar[type[LoadStepReply]] = LoadStepReply
    slots: list[int]
    node_rank: int
    total_nodes: int
    round_id: int
    ranks: dict[int, int] = field(default_factory=dict)
    world_size: int | None = None
    timeout: float = 60.0
    replica_count: int = 0
    checkpoint_dir: str = ""
    fmt: str = ""
    """The format's name (``PersistSpec.fmt``): with it the agent casts the node's vote of
    the next round itself, as the round forms (`CheckpointSaver.prepare_round`)."""

    def answer_within_s(self) -> float | None:
        """The saver may wait up to ``timeout`` before it answers."""
        return self.timeout


@dataclass(frozen=True)
class WaitPersistedRequest(SaverRequest[WaitPersistedReply]):
    """Wait up to ``timeout_s`` until ``step`` (or newer) is committed to ``checkpoint_dir``."""

    op: ClassVar[str] = "wait_persisted"
    reply_type: ClassVar[type[WaitPersistedReply]] = WaitPersistedReply
    checkpoint_dir: str
    step: int
    timeout_s: float

    def answer_within_s(self) -> float | None:
        """The saver may wait up to ``timeout_s`` before it answers."""
        return self.timeout_s


REQUEST_TYPES: tuple[type[SaverRequest[Any]], ...] = (
    AllocateRequest,
    AttachRequest,
    BeginCopyRequest,
    CopiedRequest,
    HeldRequest,
    LoadStepRequest,
    WaitPersistedRequest,
)
REPLY_TYPES: tuple[type[SaverReply], ...] = (
    AllocateReply,
    AttachReply,
    BeginCopyReply,
    CopiedReply,
    HeldReply,
    LoadStepReply,
    WaitPersistedReply,
    Refused,
    ShmSpaceRefused,
)
_REQUESTS_BY_OP = {request.op: request for request in REQUEST_TYPES}
_SHM_SPACE_KIND = "ShmSpaceError"


def encode_request(request: SaverRequest[Any]) -> bytes:
    """One JSON line of ``request``, tagged with its ``op``."""
    return encode(request, op=request.op)


def decode_request(line: bytes) -> SaverRequest[Any]:
    """The request on ``line``; MessageError if it is not a well-formed one."""
    return decode_tagged(parse(line, "saver request"), "op", _REQUESTS_BY_OP, "saver request")


def encode_reply(reply: SaverReply) -> bytes:
    """One JSON line of ``reply``; ``ok`` is false for a refusal (``kind`` names a full /dev/shm)."""
    if isinstance(reply, ShmSpaceRefused):
        return encode(reply, ok=False, kind=_SHM_SPACE_KIND)
    return encode(reply, ok=not isinstance(reply, Refused))


def decode_reply(line: bytes, expected: type[ReplyT]) -> ReplyT | Refused:
    """The saver's answer on ``line``: ``expected`` or a refusal; MessageError if malformed."""
    what = f"saver reply ({expected.__name__})"
    doc = parse(line, what)
    ok, kind = doc.pop("ok", None), doc.pop("kind", None)
    if ok is True and kind is None:
        return from_fields(expected, doc, what)
    if ok is False and kind is None:
        return from_fields(Refused, doc, what)
    if ok is False and kind == _SHM_SPACE_KIND:
        return from_fields(ShmSpaceRefused, doc, what)
    raise MessageError(
        f"{what}: expected ok true, or ok false without a kind or with kind "
        f"{_SHM_SPACE_KIND!r}; got ok {ok!r}, kind {kind!r}"
    )
