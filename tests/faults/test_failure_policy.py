"""Unit tests of the pure failure policies: every rule of the restart ladder."""

from __future__ import annotations

import pytest

from dlrover.agent.error_file import ErrorRecord
from dlrover.agent.failure_policy import (
    LEGAL_GROUP_TRANSITIONS,
    Decision,
    ExitKind,
    IllegalTransitionError,
    UserErrorSignature,
    WorkerFailure,
    WorkerFailureObservation,
    WorkerGroupState,
    check_group_transition,
    decide_worker_failure,
    user_error_signature,
)
from dlrover.decisions import FailureAction
from dlrover.master.node_policy import (
    NodeLossObservation,
    NodeLossReason,
    decide_node_loss,
)


def _error(
    exception_type: str = "ValueError",
    line: int = 10,
    message: str = "bad value",
    timestamp: float = 100.0,
    rank: int = 0,
) -> ErrorRecord:
    traceback = (
        "Traceback (most recent call last):\n"
        '  File "/job/train.py", line 40, in <module>\n    main()\n'
        f'  File "/job/train.py", line {line}, in step\n    raise X\n'
        f"{exception_type}: {message}\n"
    )
    return ErrorRecord(message, exception_type, traceback, timestamp, rank, 1234, 1)


def _user_error(rank: int = 0, **kwargs: object) -> WorkerFailure:
    return WorkerFailure(rank, ExitKind.EXITED, 1, _error(rank=rank, **kwargs))  # type: ignore[arg-type]


def _observe(
    *failures: WorkerFailure,
    restart_count: int = 0,
    max_restarts: int = 3,
    history: tuple[UserErrorSignature | None, ...] = (),
) -> Decision:
    return decide_worker_failure(
        WorkerFailureObservation(tuple(failures), restart_count, max_restarts, history)
    )


@pytest.mark.parametrize(
    "failure",
    [
        WorkerFailure(1, ExitKind.SIGNALED, -9),
        WorkerFailure(1, ExitKind.EXITED, 3),
        WorkerFailure(1, ExitKind.OOM_KILLED, -9),
        WorkerFailure(1, ExitKind.HUNG),
    ],
)
def test_worker_death_restarts_in_place_while_budget_remains(failure: WorkerFailure) -> None:
    decision = _observe(failure, restart_count=2, max_restarts=3)
    assert decision.action is FailureAction.RESTART_PROCESSES
    assert "restart 3/3" in decision.reason


def test_hang_reason_names_the_hang() -> None:
    decision = _observe(WorkerFailure(0, ExitKind.HUNG))
    assert decision.reason.startswith("hang (stacks dumped)")


@pytest.mark.parametrize("max_restarts", [0, 3])
def test_budget_exhausted_fails(max_restarts: int) -> None:
    decision = _observe(
        WorkerFailure(0, ExitKind.SIGNALED, -9),
        restart_count=max_restarts,
        max_restarts=max_restarts,
    )
    assert decision.action is FailureAction.FAIL
    assert f"budget exhausted ({max_restarts}/{max_restarts})" in decision.reason
    assert "rank 0 signal SIGKILL (9)" in decision.reason


def test_same_user_error_twice_fails_fast_with_budget_left() -> None:
    first = _user_error()
    signature = user_error_signature((first,))
    assert signature == UserErrorSignature("ValueError", "/job/train.py:10 in step")
    decision = _observe(_user_error(timestamp=200.0), restart_count=1, history=(signature,))
    assert decision.action is FailureAction.FAIL
    assert "same user error twice" in decision.reason
    assert "ValueError at /job/train.py:10 in step" in decision.reason


def test_user_error_first_time_restarts() -> None:
    assert _observe(_user_error()).action is FailureAction.RESTART_PROCESSES


@pytest.mark.parametrize(
    "previous",
    [
        UserErrorSignature("ValueError", "/job/train.py:11 in step"),  # other place
        UserErrorSignature("KeyError", "/job/train.py:10 in step"),  # other type
        None,  # previous attempt was a kill
    ],
)
def test_different_or_interrupted_error_restarts(previous: UserErrorSignature | None) -> None:
    history = (UserErrorSignature("ValueError", "/job/train.py:10 in step"), previous)
    decision = _observe(_user_error(), restart_count=2, history=history)
    assert decision.action is FailureAction.RESTART_PROCESSES


def test_same_error_not_in_a_row_restarts() -> None:
    same = UserErrorSignature("ValueError", "/job/train.py:10 in step")
    assert _observe(_user_error(), restart_count=2, history=(same, None)).action is (
        FailureAction.RESTART_PROCESSES
    )


def test_signal_death_makes_peer_errors_collateral() -> None:
    failures = (WorkerFailure(1, ExitKind.SIGNALED, -9), _user_error(rank=0))
    assert user_error_signature(failures) is None
    same = user_error_signature((_user_error(),))
    assert _observe(*failures, history=(same,)).action is FailureAction.RESTART_PROCESSES


def test_lost_connection_errors_are_not_user_errors() -> None:
    peer_gone = WorkerFailure(
        0,
        ExitKind.EXITED,
        1,
        _error("torch.distributed.DistBackendError", message="Connection closed by peer"),
    )
    assert user_error_signature((peer_gone,)) is None
    gloo = _error("RuntimeError", message="[pair.cc:534] Connection closed by peer [127.0.0.1]")
    assert user_error_signature((WorkerFailure(0, ExitKind.EXITED, 1, gloo),)) is None


def test_root_cause_is_earliest_user_error_and_needs_exit_code_1() -> None:
    early = WorkerFailure(1, ExitKind.EXITED, 1, _error("KeyError", timestamp=5.0, rank=1))
    late = WorkerFailure(0, ExitKind.EXITED, 1, _error("ValueError", timestamp=9.0))
    assert user_error_signature((late, early)) == UserErrorSignature(
        "KeyError", "/job/train.py:10 in step"
    )
    sys_exit = WorkerFailure(0, ExitKind.EXITED, 3, _error("SystemExit"))
    assert user_error_signature((sys_exit,)) is None


def test_observation_validation() -> None:
    with pytest.raises(ValueError, match="at least one failed worker"):
        WorkerFailureObservation((), 0, 3)
    with pytest.raises(ValueError, match="must be >= 0"):
        WorkerFailureObservation((_user_error(),), -1, 3)
    with pytest.raises(ValueError, match="non-zero returncode"):
        WorkerFailure(0, ExitKind.EXITED, 0)
    with pytest.raises(ValueError, match="negative returncode"):
        WorkerFailure(0, ExitKind.SIGNALED, 9)


def _loss(
    relaunch_count: int, max_relaunches: int, alive: int, min_nodes: int
) -> NodeLossObservation:
    return NodeLossObservation(
        "node-2", NodeLossReason.HEARTBEAT_TIMEOUT, relaunch_count, max_relaunches, alive, min_nodes
    )


def test_lost_node_relaunched_and_survivors_continue() -> None:
    decision = decide_node_loss(_loss(0, 2, alive=2, min_nodes=2))
    assert decision.action is FailureAction.RELAUNCH_NODE
    assert decision.survivors_continue
    assert "relaunch 1/2" in decision.reason and "heartbeat_timeout" in decision.reason


def test_lost_node_relaunched_survivors_wait_below_min() -> None:
    decision = decide_node_loss(_loss(1, 2, alive=1, min_nodes=2))
    assert decision.action is FailureAction.RELAUNCH_NODE
    assert not decision.survivors_continue


def test_no_relaunch_left_continue_smaller_or_fail() -> None:
    smaller = decide_node_loss(_loss(2, 2, alive=2, min_nodes=1))
    assert (smaller.action, smaller.survivors_continue) == (FailureAction.RESTART_PROCESSES, True)
    failed = decide_node_loss(_loss(2, 2, alive=0, min_nodes=1))
    assert (failed.action, failed.survivors_continue) == (FailureAction.FAIL, False)
    with pytest.raises(ValueError, match="min_nodes"):
        _loss(0, 1, 1, 0)


def test_state_transitions() -> None:
    check_group_transition(WorkerGroupState.RUNNING, WorkerGroupState.RESTARTING)
    check_group_transition(WorkerGroupState.RESTARTING, WorkerGroupState.RENDEZVOUS)
    with pytest.raises(IllegalTransitionError, match="succeeded -> running"):
        check_group_transition(WorkerGroupState.SUCCEEDED, WorkerGroupState.RUNNING)
    assert set(LEGAL_GROUP_TRANSITIONS) == set(WorkerGroupState)


def test_an_abort_after_the_exception_is_the_same_user_error() -> None:
    """torch/gloo can abort a process on its way out after the script's uncaught exception
    (SIGABRT: 'terminate called without an active exception'). The error file, not the
    signal, says what happened: the second identical error fails fast."""
    aborted = WorkerFailure(0, ExitKind.SIGNALED, -6, _error())
    peer = WorkerFailure(1, ExitKind.SIGNALED, -6)  # its teardown crashed too, no error file
    first = user_error_signature((_user_error(),))
    assert user_error_signature((aborted, peer)) == first
    decision = _observe(aborted, peer, restart_count=1, history=(first,))
    assert decision.action is FailureAction.FAIL
    assert "same user error twice" in decision.reason
    segfault = WorkerFailure(0, ExitKind.SIGNALED, -11, _error())
    assert user_error_signature((segfault,)) == first


def test_a_kill_from_outside_is_still_not_a_user_error() -> None:
    """A SIGKILL/SIGTERM of one rank makes the others' errors collateral, error file or not;
    an abort with no error file anywhere is a crash, restarted."""
    killed = WorkerFailure(0, ExitKind.SIGNALED, -15, _error())
    assert user_error_signature((killed,)) is None
    assert user_error_signature((WorkerFailure(1, ExitKind.SIGNALED, -6),)) is None
    oom = WorkerFailure(1, ExitKind.OOM_KILLED, -9)
    assert user_error_signature((_user_error(), oom)) is None


@pytest.mark.parametrize(
    "exception_type",
    ["dlrover.agent.bootstrap.BootstrapError", "SyntaxError", "ModuleNotFoundError", "ImportError"],
)
def test_a_program_that_cannot_start_fails_at_once_with_budget_left(exception_type: str) -> None:
    decision = _observe(
        WorkerFailure(0, ExitKind.EXITED, 2, _error(exception_type, message="no module named x")),
        restart_count=0,
        max_restarts=5,
    )
    assert decision.action is FailureAction.FAIL and decision.cannot_start
    short = exception_type.rsplit(".", 1)[-1]
    assert decision.reason.startswith(f"the program cannot start ({short}: no module named x)")
    # Any other error still restarts while budget is left.
    other = _observe(_user_error(exception_type="ValueError"), restart_count=0, max_restarts=5)
    assert other.action is FailureAction.RESTART_PROCESSES and not other.cannot_start
