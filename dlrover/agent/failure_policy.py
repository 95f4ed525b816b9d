"""Pure failure policies: what to do when workers on a node fail, or when a node is lost.

Nothing here does I/O or reads a clock: every function maps an immutable observation to a
decision, so the controller (agent or master) applies it and tests need no processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from dlrover.agent.error_file import ErrorRecord, describe_exit

USER_ERROR_EXIT_CODE = 1
"""Exit code of a Python process that died of an uncaught exception."""


class FailureAction(Enum):
    """What a controller does about a failure (the restart ladder, cheapest first)."""

    RESTART_PROCESSES = "restart_processes"
    """Stop this node's workers, re-form the world, start them again on the same node."""
    RELAUNCH_NODE = "relaunch_node"
    """Drop the node; the engine launches a replacement which joins the job."""
    RESTART_JOB = "restart_job"
    """Restart every node's workers from scratch (a controller's last resort before FAIL)."""
    FAIL = "fail"
    """Stop the job and report the root cause; exit non-zero."""


class ExitKind(Enum):
    """How a worker ended, as observed by its agent."""

    EXITED = "exited"
    """Returned a non-zero exit code."""
    SIGNALED = "signaled"
    """Killed by a signal the agent did not send."""
    OOM_KILLED = "oom_killed"
    """Killed by the kernel's out-of-memory killer (SIGKILL + the cgroup's oom_kill counter)."""
    HUNG = "hung"
    """Alive but reported no step within the hang timeout; the agent dumped its stacks."""


class WorkerGroupState(Enum):
    """The state of one agent's set of workers.

    Legal transitions (see LEGAL_GROUP_TRANSITIONS):
    INIT -> RENDEZVOUS; RENDEZVOUS -> RUNNING | FAILED | STOPPED;
    RUNNING -> SUCCEEDED | RESTARTING | FAILED | STOPPED;
    RESTARTING -> RENDEZVOUS | FAILED | STOPPED. SUCCEEDED, FAILED and STOPPED are final.
    """

    INIT = "init"
    RENDEZVOUS = "rendezvous"
    RUNNING = "running"
    RESTARTING = "restarting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"


LEGAL_GROUP_TRANSITIONS: dict[WorkerGroupState, frozenset[WorkerGroupState]] = {
    WorkerGroupState.INIT: frozenset({WorkerGroupState.RENDEZVOUS}),
    WorkerGroupState.RENDEZVOUS: frozenset(
        {WorkerGroupState.RUNNING, WorkerGroupState.FAILED, WorkerGroupState.STOPPED}
    ),
    WorkerGroupState.RUNNING: frozenset(
        {
            WorkerGroupState.SUCCEEDED,
            WorkerGroupState.RESTARTING,
            WorkerGroupState.FAILED,
            WorkerGroupState.STOPPED,
        }
    ),
    WorkerGroupState.RESTARTING: frozenset(
        {WorkerGroupState.RENDEZVOUS, WorkerGroupState.FAILED, WorkerGroupState.STOPPED}
    ),
    WorkerGroupState.SUCCEEDED: frozenset(),
    WorkerGroupState.FAILED: frozenset(),
    WorkerGroupState.STOPPED: frozenset(),
}


class NodeState(Enum):
    """The master's view of one node (agent).

    Legal transitions (see LEGAL_NODE_TRANSITIONS):
    PENDING -> RUNNING | FAILED; RUNNING -> SUCCEEDED | LOST | FAILED;
    LOST -> RELAUNCHED | FAILED. SUCCEEDED, FAILED and RELAUNCHED are final: a replacement
    is a new node with its own id, starting at PENDING.
    """

    PENDING = "pending"
    RUNNING = "running"
    LOST = "lost"
    RELAUNCHED = "relaunched"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


LEGAL_NODE_TRANSITIONS: dict[NodeState, frozenset[NodeState]] = {
    NodeState.PENDING: frozenset({NodeState.RUNNING, NodeState.FAILED}),
    NodeState.RUNNING: frozenset({NodeState.SUCCEEDED, NodeState.LOST, NodeState.FAILED}),
    NodeState.LOST: frozenset({NodeState.RELAUNCHED, NodeState.FAILED}),
    NodeState.RELAUNCHED: frozenset(),
    NodeState.SUCCEEDED: frozenset(),
    NodeState.FAILED: frozenset(),
}


class IllegalTransitionError(ValueError):
    """A state change that the state's docstring does not allow."""


def check_group_transition(old: WorkerGroupState, new: WorkerGroupState) -> None:
    if new not in LEGAL_GROUP_TRANSITIONS[old]:
        raise IllegalTransitionError(f"worker group: {old.value} -> {new.value} is not allowed")


def check_node_transition(old: NodeState, new: NodeState) -> None:
    if new not in LEGAL_NODE_TRANSITIONS[old]:
        raise IllegalTransitionError(f"node: {old.value} -> {new.value} is not allowed")


@dataclass(frozen=True)
class UserErrorSignature:
    """Identity of a user-code error: same type at the same innermost frame means 'same error'."""

    exception_type: str
    location: str


@dataclass(frozen=True)
class WorkerFailure:
    """One failed worker. Workers the agent itself stopped after the failure are not listed."""

    rank: int
    kind: ExitKind
    returncode: int | None = None
    """Popen-style: >0 exit code, <0 minus the signal number; None for HUNG."""
    error: ErrorRecord | None = None
    """The worker's error file, when it wrote one."""

    def __post_init__(self) -> None:
        if self.kind is ExitKind.HUNG:
            return
        if self.returncode is None or self.returncode == 0:
            raise ValueError(
                f"rank {self.rank}: a {self.kind.value} failure needs a non-zero returncode"
            )
        if self.kind is ExitKind.EXITED and self.returncode < 0:
            raise ValueError(f"rank {self.rank}: EXITED with returncode {self.returncode} < 0")
        if self.kind is not ExitKind.EXITED and self.returncode > 0:
            raise ValueError(f"rank {self.rank}: {self.kind.value} needs a negative returncode")

    def describe(self) -> str:
        if self.kind is ExitKind.HUNG:
            return f"rank {self.rank} hung"
        how = describe_exit(self.returncode or 0)
        if self.kind is ExitKind.OOM_KILLED:
            how = "OOM-killed"
        if self.error is not None:
            return f"rank {self.rank} {how}: {self.error.exception_type}: {self.error.message}"
        return f"rank {self.rank} {how}"


def user_error_signature(failures: tuple[WorkerFailure, ...]) -> UserErrorSignature | None:
    """The signature of an attempt whose root cause is user code, else None.

    An attempt counts as a user-code error only when no worker died by a signal, OOM or hang
    (their peers' errors are collateral), and the earliest non-collateral error file belongs to
    a worker that exited with code 1.
    """
    if any(failure.kind is not ExitKind.EXITED for failure in failures):
        return None
    recorded = [
        failure
        for failure in failures
        if failure.error is not None and not failure.error.is_collateral()
    ]
    if not recorded:
        return None
    first = min(recorded, key=lambda failure: (failure.error.timestamp, failure.rank))  # type: ignore[union-attr]
    assert first.error is not None
    if first.returncode != USER_ERROR_EXIT_CODE:
        return None
    return UserErrorSignature(first.error.exception_type, first.error.location)


@dataclass(frozen=True)
class WorkerFailureObservation:
    """Everything the agent's policy may look at when its workers failed."""

    failures: tuple[WorkerFailure, ...]
    restart_count: int
    """Restarts of this node's workers already done (TORCHELASTIC_RESTART_COUNT of the attempt)."""
    max_restarts: int
    history: tuple[UserErrorSignature | None, ...] = field(default=())
    """One entry per earlier failed attempt of this node, oldest first (None: not a user error)."""

    def __post_init__(self) -> None:
        if not self.failures:
            raise ValueError("a failure observation needs at least one failed worker")
        if self.restart_count < 0 or self.max_restarts < 0:
            raise ValueError(
                f"restart_count ({self.restart_count}) and max_restarts ({self.max_restarts}) "
                "must be >= 0"
            )


@dataclass(frozen=True)
class Decision:
    """A policy's answer: the action, and a one-line reason for the log and the user."""

    action: FailureAction
    reason: str


def decide_worker_failure(observation: WorkerFailureObservation) -> Decision:
    """The agent's restart ladder for its own workers.

    1. the same user-code error as the previous failed attempt (same exception type at the
       same innermost frame, exit code 1) -> FAIL at once, whatever budget is left;
    2. restart budget used up (restart_count >= max_restarts) -> FAIL;
    3. otherwise (signal, non-zero exit, OOM kill, hang) -> RESTART_PROCESSES.
    """
    failures = observation.failures
    summary = "; ".join(failure.describe() for failure in failures)
    signature = user_error_signature(failures)
    previous = observation.history[-1] if observation.history else None
    if signature is not None and signature == previous:
        return Decision(
            FailureAction.FAIL,
            f"same user error twice in a row ({signature.exception_type} at "
            f"{signature.location or 'unknown location'}): failing fast; {summary}",
        )
    if observation.restart_count >= observation.max_restarts:
        return Decision(
            FailureAction.FAIL,
            f"restart budget exhausted ({observation.restart_count}/{observation.max_restarts}); "
            f"{summary}",
        )
    hung = any(failure.kind is ExitKind.HUNG for failure in failures)
    cause = "hang (stacks dumped)" if hung else "worker failure"
    return Decision(
        FailureAction.RESTART_PROCESSES,
        f"{cause}, restart {observation.restart_count + 1}/{observation.max_restarts}; {summary}",
    )


class NodeLossReason(Enum):
    """Why the master considers a node lost."""

    HEARTBEAT_TIMEOUT = "heartbeat_timeout"
    PROCESS_EXITED = "process_exited"
    """The engine reports the agent process (or pod/actor) gone."""
    OOM_KILLED = "oom_killed"
    """The engine reports the node killed for memory."""


@dataclass(frozen=True)
class NodeLossObservation:
    """The master's view when one node is lost."""

    node_id: str
    reason: NodeLossReason
    relaunch_count: int
    """Replacements already launched for this node slot."""
    max_relaunches: int
    alive_nodes: int
    """Nodes still running, not counting the lost one."""
    min_nodes: int

    def __post_init__(self) -> None:
        if min(self.relaunch_count, self.max_relaunches, self.alive_nodes) < 0:
            raise ValueError("relaunch_count, max_relaunches and alive_nodes must be >= 0")
        if self.min_nodes < 1:
            raise ValueError(f"min_nodes must be >= 1, got {self.min_nodes}")


@dataclass(frozen=True)
class NodeLossDecision:
    """The master's answer to a lost node.

    `action` is RELAUNCH_NODE (launch a replacement), RESTART_PROCESSES (no replacement, the
    survivors re-form at the smaller size) or FAIL. `survivors_continue` says whether the
    survivors re-form now without waiting for the replacement (at least min_nodes remain).
    """

    action: FailureAction
    survivors_continue: bool
    reason: str


def decide_node_loss(observation: NodeLossObservation) -> NodeLossDecision:
    """Relaunch while relaunches remain; survivors go on when at least min_nodes are alive."""
    enough = observation.alive_nodes >= observation.min_nodes
    size = f"{observation.alive_nodes} alive, min {observation.min_nodes}"
    lost = f"node {observation.node_id} lost ({observation.reason.value})"
    if observation.relaunch_count < observation.max_relaunches:
        then = "survivors re-form now" if enough else "survivors wait for the replacement"
        return NodeLossDecision(
            FailureAction.RELAUNCH_NODE,
            enough,
            f"{lost}: relaunch {observation.relaunch_count + 1}/{observation.max_relaunches}, "
            f"{then} ({size})",
        )
    if enough:
        return NodeLossDecision(
            FailureAction.RESTART_PROCESSES,
            True,
            f"{lost}: no relaunch left ({observation.max_relaunches}), survivors re-form "
            f"smaller ({size})",
        )
    return NodeLossDecision(
        FailureAction.FAIL,
        False,
        f"{lost}: no relaunch left ({observation.max_relaunches}) and too few nodes ({size})",
    )
