"""Pure failure policies: what to do when workers on a node fail, or when a node is lost.

Nothing here does I/O or reads a clock: every function maps an immutable observation to a
decision, so the controller (agent or master) applies it and tests need no processes.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from enum import Enum

from dlrover.agent.error_file import ErrorRecord, describe_exit
from dlrover.decisions import FailureAction

USER_ERROR_EXIT_CODE = 1

CANNOT_START_ERRORS = frozenset(
    {
        "BootstrapError",  # the script or module is not there (dlrover.agent.bootstrap)
        "SyntaxError",
        "IndentationError",
        "TabError",
        "ModuleNotFoundError",
        "ImportError",
    }
)
"""Errors that no restart cures: the program cannot start (its code or its imports are wrong)."""
"""Exit code of a Python process that died of an uncaught exception."""


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
    INIT -> RENDEZVOUS; RENDEZVOUS -> RENDEZVOUS (after a node check) | RUNNING | FAILED | STOPPED;
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
        {
            WorkerGroupState.RENDEZVOUS,  # the node check sent the node to join again
            WorkerGroupState.RUNNING,
            WorkerGroupState.FAILED,
            WorkerGroupState.STOPPED,
        }
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


class IllegalTransitionError(ValueError):
    """A state change that the state's docstring does not allow."""


def check_group_transition(old: WorkerGroupState, new: WorkerGroupState) -> None:
    """Raise IllegalTransitionError unless ``old -> new`` is in LEGAL_GROUP_TRANSITIONS."""
    if new not in LEGAL_GROUP_TRANSITIONS[old]:
        raise IllegalTransitionError(f"worker group: {old.value} -> {new.value} is not allowed")


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
        """One line for logs, e.g. ``rank 3 exit code 1: ValueError: bad shape``."""
        if self.kind is ExitKind.HUNG:
            return f"rank {self.rank} hung"
        how = describe_exit(self.returncode or 0)
        if self.kind is ExitKind.OOM_KILLED:
            how = "OOM-killed"
        if self.error is not None:
            return f"rank {self.rank} {how}: {self.error.exception_type}: {self.error.message}"
        return f"rank {self.rank} {how}"


TEARDOWN_SIGNALS = frozenset({-signal.SIGABRT, -signal.SIGSEGV})
"""Deaths a process gives itself, e.g. torch/gloo aborting in its teardown after the script's
uncaught exception (``terminate called without an active exception``); not a kill from outside."""


def user_error_signature(failures: tuple[WorkerFailure, ...]) -> UserErrorSignature | None:
    """The signature of an attempt whose root cause is user code, else None.

    The error files say what the root cause is, not the exit statuses: the earliest error file
    that is not collateral (a lost peer) names it, when its worker exited with code 1 or died
    by SIGABRT/SIGSEGV after writing it (the uncaught exception, then a crash on the way out).
    No user error when a worker was OOM-killed, hung, or killed by any other signal (a kill
    from outside: its peers' errors are collateral).
    """
    for failure in failures:
        if failure.kind in (ExitKind.OOM_KILLED, ExitKind.HUNG):
            return None
        if failure.kind is ExitKind.SIGNALED and failure.returncode not in TEARDOWN_SIGNALS:
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
    if first.returncode != USER_ERROR_EXIT_CODE and first.kind is not ExitKind.SIGNALED:
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
    cannot_start: bool = False
    """The program cannot start (CANNOT_START_ERRORS): the node fails without a relaunch."""


def decide_worker_failure(observation: WorkerFailureObservation) -> Decision:
    """The agent's restart ladder for its own workers.

    0. the program cannot start (a missing script or module, a syntax or import error:
       CANNOT_START_ERRORS) -> FAIL at once, marked ``cannot_start``;
    1. the same user-code error as the previous failed attempt (same exception type at the
       same innermost frame, from the error file; exit code 1, or an abort after the
       exception) -> FAIL at once, whatever budget is left;
    2. restart budget used up (restart_count >= max_restarts) -> FAIL;
    3. otherwise (signal, non-zero exit, OOM kill, hang) -> RESTART_PROCESSES.
    """
    failures = observation.failures
    summary = "; ".join(failure.describe() for failure in failures)
    for failure in failures:
        error = failure.error
        if error is not None and not error.is_collateral():
            short = error.exception_type.rsplit(".", 1)[-1]
            if short in CANNOT_START_ERRORS:
                return Decision(
                    FailureAction.FAIL,
                    f"the program cannot start ({short}: {error.message}): no restart or "
                    f"relaunch cures that; fix the command or the script; {summary}",
                    cannot_start=True,
                )
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
