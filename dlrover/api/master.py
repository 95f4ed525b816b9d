"""The master's API as the node side sees it: typed requests and answers, and `MasterApi`.

`MasterApi` is the one source of each of its RPCs (see `dlrover.api.rpc`). Two
implementations: `dlrover.master.local_api.LocalMasterApi` (the calls on a JobMaster in this
process; the gRPC servicer is derived from this interface and calls it, and agent tests use it
without a server) and `dlrover.client.master_client.MasterClient` (gRPC, derived from it).
"""

from __future__ import annotations

import enum
import hashlib
import posixpath
from dataclasses import dataclass, field
from typing import Protocol

from dlrover.api.rpc import INVERT, Run, rpc
from dlrover.constants import MAX_CHECKPOINT_WAIT_S


class HeartbeatAction(str, enum.Enum):
    """What the master asks an agent to do in answer to a heartbeat."""

    NONE = ""
    STOP = "stop"
    """The job has ended: stop the workers and exit."""
    REREGISTER = "reregister"
    """The master took this node for lost (or restarted without it): register again."""


class NodeOutcome(str, enum.Enum):
    """How an agent's workers finished, as it reports to the master."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(frozen=True)
class NodeLimits:
    """The job's elastic range as agents launch it (--nnodes MIN:MAX, node unit, last call)."""

    min_nodes: int
    max_nodes: int
    node_unit: int = 1
    last_call_timeout_s: float = 0.0


@dataclass(frozen=True)
class Registration:
    """An agent announces itself. ``node_id`` is empty for a new agent, or the id a restarted
    agent had; ``requested_rank`` is --node-rank or -1; ``limits`` fixes the job's range on
    the first registration and must match it on the others."""

    host: str
    local_world_size: int
    node_id: str = ""
    role: str = "default"
    requested_rank: int = -1
    pid: int = 0
    limits: NodeLimits | None = None
    job_name: str = ""


@dataclass(frozen=True)
class Registered:
    """The master's answer: the node's id, its incarnation (fences a stale agent), the job's
    range and name, and how often to heartbeat (0: the agent's own interval)."""

    node_id: str
    incarnation: int
    limits: NodeLimits
    job_name: str
    heartbeat_interval_s: float = 0.0


@dataclass(frozen=True)
class HeartbeatReport:
    """Liveness, resource usage, progress and the worker group's state of one node."""

    node_id: str
    incarnation: int
    cpu_percent: float = 0.0
    memory_bytes: int = 0
    step: int = -1
    worker_state: str = ""
    restart_count: int = 0
    step_time_s: float = 0.0
    """The node's busy seconds per training step lately (0.0: not measured yet)."""
    attempt_step: int = -1
    """The step of the node's current workers (-1: none yet); goes back after a restart."""
    attempt_step_age_s: float = 0.0
    """Seconds since the workers reported ``attempt_step``."""
    attempt_first_step: int = -1
    """The first step the agent saw these workers report (-1: none yet)."""
    attempt_first_age_s: float = 0.0
    """Seconds since they reported ``attempt_first_step``."""
    step_wall_s: float = 0.0
    """Wall seconds per step of the slowest worker lately (0.0: not measured yet)."""
    step_data_s: float = 0.0
    """The part of it spent waiting for input (as the script reported it)."""
    step_checkpoint_s: float = 0.0
    """The part of it blocked in checkpoint saves (as the script reported it)."""
    checkpoint_persist_s: float = 0.0
    """How long the node's latest flash-checkpoint persist took (0.0: none yet)."""
    worker_pids: tuple[int, ...] = ()
    """The process ids of the node's current workers, by local rank (empty between attempts)."""
    samples_per_s: float = 0.0
    """Samples per second of the node's workers together lately, as their scripts reported
    samples (0.0: none reported)."""


@dataclass(frozen=True)
class HeartbeatReply:
    """The master's answer to a heartbeat: what the agent must do, and the job's state (a
    ``JobState`` value: pending, running, succeeded or failed)."""

    action: HeartbeatAction
    job_state: str
    heartbeat_interval_s: float = 0.0
    """When to beat next: the master stretches the interval as the job grows, so that all
    heartbeats together stay within its budget (0: keep the agent's own interval)."""
    heartbeat_port: int = 0
    """Where to beat next: this port on the master's host, a server of the master's that serves
    heartbeats alone, so that they are answered at once whatever else the master is busy with
    (0: the master's own address). Set by the master's gRPC server, not by the job."""


@dataclass(frozen=True)
class JoinRequest:
    """Join the next rendezvous round; ``store_host:store_port`` is where this node's rank-0
    worker would host the process-group store if it becomes node rank 0."""

    node_id: str
    incarnation: int
    local_world_size: int
    store_host: str
    store_port: int


@dataclass(frozen=True)
class CommWorld:
    """A rendezvous round as one node sees it; ``complete`` is False while the master waits."""

    round: int
    complete: bool
    num_nodes: int = 0
    """Nodes in the round (the member list stays in the master: a node needs only the count)."""
    node_rank: int = -1
    world_size: int = 0
    rank_offset: int = 0
    store_host: str = ""
    store_port: int = 0
    rejoin: bool = False
    """The master does not know this node to wait for the round (it restarted since the node
    joined): the node must join again."""
    spare: bool = False
    """Incomplete: the node waits as a hot spare (a round runs at max nodes without it); it
    takes the place of the next node lost, without a launch."""
    spread_s: float = 0.0
    """Complete: the node starts its membership watch at a random point within this many
    seconds (a large job's watches do not all reach the master at once)."""


@dataclass(frozen=True)
class Waiting:
    """Nodes waiting for a round that should re-form the running world, and the newest round
    (an agent on an older one must re-form)."""

    waiting: int
    latest_round: int
    job_ended: bool = False
    """The job has ended: the agent stops its workers and reads the job's status."""
    spread_s: float = 0.0
    """The world must re-form: the node joins again at a random point within this many seconds
    (a large job's survivors do not all reach the master at once)."""


@dataclass(frozen=True)
class NodeReport:
    """An agent's workers finished for good."""

    node_id: str
    incarnation: int
    outcome: NodeOutcome
    exit_code: int = 0
    reason: str = ""


class NodeCheckState(str, enum.Enum):
    """What a node joining a round of the pre-flight node check is told."""

    WAIT = "wait"
    """Not every member has joined this check round yet: ask again."""
    RUN = "run"
    """Run the check with `NodeCheckTask.peers` (none: sit this round out)."""
    DONE = "done"
    """The check is over: train, or leave the job when `NodeCheckTask.excluded`."""
    REFORM = "reform"
    """The check is over but the world changed (a member was excluded or lost): join again."""


@dataclass(frozen=True)
class NodeCheckJoin:
    """A node is ready for round ``check_round`` of the node check of rendezvous round
    ``rdzv_round``; ``addr`` (host:port) is where it would host its group's store. The
    straggler settings of the first node to join a check apply to it."""

    node_id: str
    incarnation: int
    rdzv_round: int
    check_round: int
    addr: str
    straggler_ratio: float = 2.0
    exclude_stragglers: bool = False


@dataclass(frozen=True)
class NodeCheckTask:
    """The master's answer to a NodeCheckJoin."""

    state: NodeCheckState
    check_round: int = 0
    peers: tuple[str, ...] = ()
    """This check round's group (host:port each, in group rank order; peers[0] hosts its
    store)."""
    index: int = 0
    """This node's rank in the group."""
    excluded: bool = False
    reason: str = ""
    """Why this node is excluded."""
    summary: str = ""
    """The check's verdict in one line."""


@dataclass(frozen=True)
class NodeCheckReport:
    """A node's result of one check round: compute (matmul) and collective (allreduce) seconds,
    or the error that failed it."""

    node_id: str
    incarnation: int
    rdzv_round: int
    check_round: int
    ok: bool
    compute_s: float = 0.0
    comm_s: float = 0.0
    error: str = ""


class FailureClass(str, enum.Enum):
    """What kind of failure the master recorded (`dlrover diagnose` prints them)."""

    USER_ERROR = "user_error"
    """The training script raised (an error file names the exception and where)."""
    COLLATERAL = "collateral"
    """A worker failed because a peer did: every error its node's workers wrote is a broken
    connection to a peer or a collective's timeout or abort. Never a root cause while a failure
    of another class is recorded for the same round, and never counted toward failing fast."""
    OOM = "oom"
    """Killed for memory: the kernel's OOM killer (cgroup oom_kill), or the pod / actor OOM."""
    SIGNAL = "signal"
    """A worker or node was killed by a signal (not for memory)."""
    EXIT_CODE = "exit_code"
    """A process exited non-zero without an error file."""
    HANG = "hang"
    """Workers reported no step within --hang-timeout."""
    NODE_LOST = "node_lost"
    """The node vanished: machine, pod or actor gone, or no heartbeat."""
    CHECK_FAILED = "check_failed"
    """The node check found the node faulty."""
    STRAGGLER = "straggler"
    """The node check or the runtime scores found the node slow."""


@dataclass(frozen=True)
class FailureRecord:
    """One failure as the master keeps it: when, where, its class, its root cause, and what
    was done about it (a FailureAction value, or ``exclude``)."""

    at: float
    """Unix time."""
    node_id: str
    failure_class: FailureClass
    action: str
    root_cause: str
    restart_count: int = 0
    """The node's worker restarts before this failure."""
    round: int = 0
    """The rendezvous round the failure led to: the next round formed after it (0: none yet,
    or the job ended first)."""
    cost_s: float = 0.0
    """What the failure cost the job: from its last progress before the failure until it went
    past that step again (0: not back there yet); the master fills it in as it answers."""
    signature: str = ""
    """A user error's identity, its exception type at its innermost frame
    (``RuntimeError at train.py:42 in step``): the same twice in a row fails the job fast,
    whichever node raised it ("" for other classes)."""
    collectives: str = ""
    """A hang's collectives, JSON: global rank -> the last collective it entered per process
    group and its stack's tail (`dlrover.agent.collectives`); "" for other classes."""
    count: int = 1
    """How many failures this record stands for: `DiagnosticsApi.get_failures` folds the
    failures of one class, action and round whose root causes differ in numbers only (a rank,
    a pid, an address) into one record, the newest's fields with this count."""
    first_at: float = 0.0
    """Unix time of the first failure folded into this record (0.0: ``at``, one failure)."""
    node_count: int = 0
    """How many nodes the folded failures came from (0: one failure, ``node_id``'s)."""


@dataclass(frozen=True)
class NodeStatus:
    """One node as ``dlrover status`` shows it. ``state`` is a ``NodeState`` value; ``step`` is the
    highest step reported (-1 before any); ``last_heartbeat_age_s`` is seconds since its last sign
    of life; ``memory_bytes`` is in bytes."""

    node_id: str
    state: str
    node_rank: int
    host: str
    step: int
    restart_count: int
    last_heartbeat_age_s: float
    role: str
    cpu_percent: float
    memory_bytes: int
    check: str = ""
    """The node check's word on it: ``ok 0.31s``, ``straggler 3.0x``, ``faulty``, or ""."""
    score: float = 0.0
    """Its last runtime straggler score: the fastest node's step time / its own (0.0: none)."""
    step_wall_s: float = 0.0
    """Seconds per step lately (0.0: not measured), and its data-wait and checkpoint parts."""
    step_data_s: float = 0.0
    step_checkpoint_s: float = 0.0
    pid: int = 0
    """The agent's process id as it registered (0: unknown), on ``host``."""
    worker_pids: tuple[int, ...] = ()
    """Its workers' process ids by local rank, as its last heartbeat said (empty: none)."""
    memory_limit_bytes: int = 0
    """Its memory limit (0: none asked); given for the nodes a role controller drives."""
    samples_per_s: float = 0.0
    """Its workers' samples per second lately (0.0: their scripts report no samples)."""


@dataclass(frozen=True)
class EmbeddingServerStatus:
    """One embedding server of a job with a ps role, as the master last read it."""

    index: int
    address: str
    rows: int
    bytes: int
    lookups_per_s: float


@dataclass(frozen=True)
class JobStatus:
    """The job as the master sees it (``dlrover status``)."""

    job_name: str
    state: str
    round: int
    reason: str = ""
    exit_code: int = 0
    nodes: tuple[NodeStatus, ...] = field(default=())
    node_check: str = ""
    """The last node check's verdict in one line ("" when none ran)."""
    autoscale: str = ""
    """The auto-scaler's latest plan in one line ("" without --auto-scale)."""
    goodput: float = 0.0
    """Productive step time / time since the master started (a live estimate)."""
    metrics_port: int = 0
    """The port of /metrics and the dashboard on the master's host (0: none)."""
    embedding_servers: tuple[EmbeddingServerStatus, ...] = field(default=())
    """A job with a ps role: its embedding servers, server 0 first."""
    steps_per_s: float = 0.0
    """A TensorFlow job's steps (batches) per second lately, from its chief (0.0: none)."""
    samples_per_s: float = 0.0
    """A TensorFlow job's samples per second lately (0.0: not measured yet)."""
    data_lost: str = ""
    """What the at-most-once datasets and streams lost, in one line ("" when none is)."""

    @property
    def ended(self) -> bool:
        """True once the job has succeeded or failed; an ended job never runs again."""
        return self.state in ("succeeded", "failed")


class MembershipApi(Protocol):
    """Who is in the job: registration, heartbeats, rendezvous rounds and progress (served by
    the master's `Membership`)."""

    def register_node(self, registration: Registration) -> Registered:
        """Admit an agent: a new node id, or the same id with a bumped incarnation for a restarted
        agent. The first registration must carry ``limits`` and fixes the job's range; a later one
        whose min/max nodes differ is refused (MasterRequestError)."""
        ...

    def heartbeat(self, report: HeartbeatReport) -> HeartbeatReply:
        """Record this incarnation's liveness, usage and step; the reply says to stop or register
        again. Raises UnknownNodeError for an unknown node, MasterRequestError for a stale
        incarnation."""
        ...

    def join_rendezvous(self, request: JoinRequest) -> int:
        """The round number joined."""
        ...

    @rpc(run=Run.POLL, poll="comm_world_poll")
    def get_comm_world(self, node_id: str, round: int, wait_s: float = 0.0) -> CommWorld:
        """The world of the round this node waits for or belongs to; ``complete`` is False until
        that round closes (ask again). ``wait_s`` > 0 makes it a long poll: the answer comes as
        soon as the round closes (or the node must join again), or after ``wait_s`` (capped by
        the master) incomplete."""
        ...

    @rpc(run=Run.POLL, poll="membership_poll")
    def num_nodes_waiting(self, node_id: str, round: int, wait_s: float = 0.0) -> Waiting:
        """How many waiting nodes should make this node's running world re-form now, and the newest
        round (0 waiting: carry on). ``wait_s`` > 0 makes it a membership watch: the answer comes
        as soon as the world must re-form or the job ends, or after ``wait_s`` (capped by the
        master) with nothing to do."""
        ...

    def report_step(
        self,
        step: int,
        rank: int | None = None,
        metrics: dict[str, float] | None = None,
        node_id: str | None = None,
    ) -> None:
        """A training process finished ``step``: the node's progress, and a sign of life. The master
        keeps the node's highest step; ``rank`` and ``metrics`` are not stored."""
        ...


class LifecycleApi(Protocol):
    """The job's end: the exit barrier and a stop from outside (served by `JobLifecycle`)."""

    @rpc(run=Run.POLL, poll="exit_poll")
    def report_node_status(self, report: NodeReport, wait_s: float = 0.0) -> bool:
        """True once every node of the final world has succeeded (the exit barrier). ``wait_s`` > 0
        holds the call until the job has ended or ``wait_s`` (capped by the master) passed."""
        ...

    def stop_job(self, reason: str) -> JobStatus:
        """End the job as failed with ``reason`` (nothing if it already ended; agents learn it from
        their next heartbeat); returns the job's status after."""
        ...


class StatusApi(Protocol):
    """The job as the master sees it now (served by `JobStatusView`)."""

    @rpc(fields={"with_nodes": ("without_nodes", INVERT)})
    def get_job_status(self, with_nodes: bool = True) -> JobStatus:
        """The job and (unless ``with_nodes`` is False) every node it knows, as the master sees
        them now."""
        ...


class RolesApi(Protocol):
    """Scaling a role on request (served by the job's `RoleRegistry`)."""

    def scale_role(self, role: str, count: int) -> tuple[str, int]:
        """Ask for ``count`` nodes of ``role`` (today the embedding servers, role ps): what the
        master will do, and the id its report will carry; refused (MasterRequestError) for a
        role that cannot be scaled."""
        ...


class NodeCheckApi(Protocol):
    """The pre-flight node check of each round (served by `Preflight`)."""

    @rpc(run=Run.POLL, poll="node_check_poll")
    def join_node_check(self, join: NodeCheckJoin, wait_s: float = 0.0) -> NodeCheckTask:
        """Join a round of the pre-flight node check; waits up to ``wait_s`` for every member to
        join (then the task is RUN) or for the verdict (DONE / REFORM); WAIT if neither came."""
        ...

    def report_node_check(self, report: NodeCheckReport) -> None:
        """Report this node's result of a check round."""
        ...


class DiagnosticsApi(Protocol):
    """The failure log (served by `Diagnostics`)."""

    def report_failure(self, node_id: str, incarnation: int, record: FailureRecord) -> None:
        """Record a failure of this node's workers, classified, with the action taken."""
        ...

    def get_failures(self) -> tuple[FailureRecord, ...]:
        """Every failure the job recorded, oldest first (`dlrover diagnose`)."""
        ...


class KvApi(Protocol):
    """The job's small key-value store (served by `KvStore`)."""

    def kv_set(self, key: str, value: bytes) -> None:
        """Publish ``value`` under ``key`` and wake its readers; refused (MasterRequestError) for an
        empty key, a value over MAX_KV_VALUE_BYTES or a full store."""
        ...

    @rpc(run=Run.POOL_IF_WAITING)
    def kv_get(self, key: str, wait_s: float = 0.0) -> bytes | None:
        """The value of ``key``, waiting up to ``wait_s`` seconds for it to appear; None if it did
        not."""
        ...


class CheckpointApi(Protocol):
    """Flash-checkpoint coordination: the commit of a step and the load-step vote (served by
    `dlrover.checkpoint.coordinator.CommitVotes`)."""

    def checkpoint_persisted(self, step: int, node_rank: int, total_nodes: int) -> bool:
        """This node wrote all its files of ``step``; True for the one node that commits it."""
        ...

    @rpc("CheckpointCommitted", run=Run.POOL, fixed={"mark": True})
    def checkpoint_committed(self, step: int) -> None:
        """The committer announces that ``step`` is committed: waiters on it (or an older step)
        return True."""
        ...

    @rpc(
        "CheckpointCommitted", run=Run.POOL, max_wait_s=MAX_CHECKPOINT_WAIT_S, fixed={"mark": False}
    )
    def wait_checkpoint_committed(self, step: int, wait_s: float) -> bool:
        """Whether ``step`` (or a newer one) is committed within ``wait_s`` seconds."""
        ...

    @rpc("AgreeLoadStep", run=Run.POOL, max_wait_s=MAX_CHECKPOINT_WAIT_S)
    def vote_load_step(
        self, node_rank: int, total_nodes: int, local_step: int | None, round_id: int, wait_s: float
    ) -> tuple[bool, int | None]:
        """(decided, step) of the round's load-step vote (see dlrover.checkpoint.coordinator)."""
        ...


@dataclass(frozen=True)
class CacheFile:
    """One file of the job's shared compile cache: its path under the cache folder, its size in
    bytes and the blake2b digest of its content (hex)."""

    name: str
    size: int
    digest: str


CACHE_CHUNK_BYTES = 2 * 1024 * 1024
"""The most bytes one cache read or write carries (under gRPC's 4 MiB message limit)."""


def cache_digest(data: bytes) -> str:
    """The digest of a cache file's content as `CacheFile.digest` states it (blake2b, hex)."""
    return hashlib.blake2b(data, digest_size=20).hexdigest()


def checked_cache_name(name: str) -> str:
    """``name`` as a relative path inside a cache folder; ValueError for anything else (an
    absolute path, one that climbs out with "..", one not in its normal form)."""
    clean = posixpath.normpath(name)
    if not name or clean != name or name.startswith("/") or clean.split("/")[0] == "..":
        raise ValueError(f"compile cache file {name!r}: not a relative path inside the folder")
    return clean


class CompileCacheApi(Protocol):
    """The job's compile caches, kept by the master for nodes that share no filesystem
    (``--compile-cache master``; served by `dlrover.master.compile_cache.CompileCacheStore`)."""

    def cache_files(self) -> tuple[CacheFile, ...]:
        """Every complete file the job's nodes shared so far."""
        ...

    def cache_read(self, name: str, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes of file ``name`` from ``offset`` (at most CACHE_CHUNK_BYTES);
        refused (MasterRequestError) for a file the master does not hold."""
        ...

    def cache_write(self, name: str, size: int, digest: str, offset: int, data: bytes) -> bool:
        """A part of file ``name`` (``size`` bytes in all, content digest ``digest``), sent in
        order from offset 0; True once the file is complete and its digest matched. Refused
        for a name that leaves the cache folder, a part out of order, a file over
        MAX_CACHE_FILE_BYTES or a full cache."""
        ...


class MasterApi(
    MembershipApi,
    LifecycleApi,
    StatusApi,
    RolesApi,
    NodeCheckApi,
    DiagnosticsApi,
    KvApi,
    CheckpointApi,
    CompileCacheApi,
    Protocol,
):
    """The calls an agent and a training process make to the job master: the interfaces of its
    parts together.

    Each method is one RPC of the proto's service (dlrover/api/rpc.py says how), served by the
    part whose interface has it; adding one is three edits: the proto, the part's interface,
    and the part's method.

    Errors (``dlrover.api.errors``), the same in process (`LocalMasterApi`) and over gRPC:
    ``MasterRequestError`` for a refused request (stale incarnation, bad configuration),
    ``UnknownNodeError`` for a node id the master does not know (register again).
    """


MASTER_PARTS: tuple[type, ...] = tuple(b for b in MasterApi.__bases__ if b is not Protocol)
"""The part interfaces `MasterApi` is made of, each served by one part of the master."""
