"""Failure classification, per class: the agent's (its workers), the master's (engine events),
and the failure log the master keeps in its state."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from dlrover.agent.error_file import ErrorRecord
from dlrover.agent.failure_policy import ExitKind, WorkerFailure
from dlrover.agent.failures import classify, judge
from dlrover.api.master import FailureClass, FailureRecord
from dlrover.engines.base import FailureReason, NodeEvent, NodeSpec, NodeState
from dlrover.master.diagnosis import (
    MAX_CAUSE_CHARS,
    MAX_FAILURES,
    load_failures,
    load_folded,
)
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.node_controller import failure_class_of
from dlrover.master.state_store import MemoryStateStore, SqliteStateStore


def _error() -> ErrorRecord:
    return ErrorRecord(
        message="bad shape", exception_type="ValueError", traceback="", timestamp=0.0, rank=0,
        pid=1, exit_code=1,
    )  # fmt: skip


def _peer_gone(
    message: str = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer",
) -> ErrorRecord:
    return ErrorRecord(
        message=message, exception_type="RuntimeError", traceback="", timestamp=0.0, rank=1,
        pid=2, exit_code=1,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("failures", "expected"),
    [
        ([WorkerFailure(0, ExitKind.HUNG)], FailureClass.HANG),
        ([WorkerFailure(0, ExitKind.OOM_KILLED, -9)], FailureClass.OOM),
        ([WorkerFailure(0, ExitKind.EXITED, 1, _error())], FailureClass.USER_ERROR),
        ([WorkerFailure(0, ExitKind.SIGNALED, -11)], FailureClass.SIGNAL),
        ([WorkerFailure(0, ExitKind.EXITED, 3)], FailureClass.EXIT_CODE),
        # the most telling worker wins: a hang over an exit, an OOM over a signal
        (
            [WorkerFailure(0, ExitKind.EXITED, 3), WorkerFailure(1, ExitKind.HUNG)],
            FailureClass.HANG,
        ),
        (
            [WorkerFailure(0, ExitKind.SIGNALED, -6), WorkerFailure(1, ExitKind.OOM_KILLED, -9)],
            FailureClass.OOM,
        ),
        # a peer went away: every error on this node is collateral, from gloo or NCCL
        ([WorkerFailure(1, ExitKind.EXITED, 1, _peer_gone())], FailureClass.COLLATERAL),
        (
            [
                WorkerFailure(
                    1,
                    ExitKind.EXITED,
                    1,
                    _peer_gone("Timed out waiting 30000ms for recv operation to complete"),
                )
            ],
            FailureClass.COLLATERAL,
        ),  # fmt: skip
        # ... but a kill here, or a user error beside it, is this node's own cause
        (
            [
                WorkerFailure(0, ExitKind.SIGNALED, -9),
                WorkerFailure(1, ExitKind.EXITED, 1, _peer_gone()),
            ],
            FailureClass.SIGNAL,
        ),
        (
            [
                WorkerFailure(0, ExitKind.EXITED, 1, _error()),
                WorkerFailure(1, ExitKind.EXITED, 1, _peer_gone()),
            ],
            FailureClass.USER_ERROR,
        ),
    ],
)
def test_worker_failures_are_classified(failures: list[WorkerFailure], expected: FailureClass):
    assert classify(failures) is expected


def test_a_sigkill_is_an_oom_kill_only_when_the_cgroup_counted_one() -> None:
    kwargs = dict(error_files={}, hung=[], restart_count=0, max_restarts=3, history=[], node="n")
    plain = judge({1: -signal.SIGKILL}, **kwargs)  # type: ignore[arg-type]
    oom = judge({1: -signal.SIGKILL}, oom_killed=True, **kwargs)  # type: ignore[arg-type]
    assert plain.failure_class is FailureClass.SIGNAL
    assert oom.failure_class is FailureClass.OOM and "OOM-killed" in oom.summary
    other = judge({1: -signal.SIGSEGV}, oom_killed=True, **kwargs)  # type: ignore[arg-type]
    assert other.failure_class is FailureClass.SIGNAL  # only SIGKILL is the OOM killer's


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        (FailureReason.OOM_KILLED, FailureClass.OOM),
        (FailureReason.SIGNAL, FailureClass.SIGNAL),
        (FailureReason.EXIT_CODE, FailureClass.EXIT_CODE),
        (FailureReason.NODE_LOST, FailureClass.NODE_LOST),
        (FailureReason.PREEMPTED, FailureClass.NODE_LOST),
        (FailureReason.LAUNCH_FAILED, FailureClass.NODE_LOST),
    ],
)
def test_engine_failures_are_classified(reason: FailureReason, expected: FailureClass) -> None:
    spec = NodeSpec(job_name="j", rank=0, command=("true",))
    event = NodeEvent(spec.node_id, spec, NodeState.FAILED, reason)
    assert failure_class_of(event) is expected


def test_the_failure_log_outlives_the_master_and_keeps_the_newest(tmp_path: Path) -> None:
    store = SqliteStateStore(str(tmp_path / "state.db"))
    job = JobMaster(JobMasterConfig(job_name="j"), store)
    for i in range(MAX_FAILURES + 5):
        job.diagnostics.record_failure(
            FailureRecord(float(i), f"n{i}", FailureClass.SIGNAL, "restart_processes", "x")
        )
    kept = job.diagnostics.failures()
    assert len(kept) == MAX_FAILURES and kept[0].node_id == "n5"
    again = JobMaster(JobMasterConfig(job_name="j"), store)  # a restarted master
    assert again.diagnostics.failures() == kept
    assert [r for _, r in load_failures(store)] == list(kept)
    store.close()


def _stack(node: int) -> str:
    """A 64 KB report: a summary line, the same frames on every node, its own numbers in the
    last line."""
    frames = "".join(
        f'  File "model.py", line {k}, in forward\n    x = layer(x)\n' for k in range(1400)
    )
    return (
        f"worker rank {node} exited with 1: DistBackendError\nTraceback:\n{frames}"
        f"DistBackendError: NCCL error on rank {node}, pid {1000 + node}"
    )


def test_a_storm_of_one_error_is_kept_bounded_and_answered_as_one_record(tmp_path: Path) -> None:
    """Every node of a job reports the same failure (numbers aside) with a 64 KB stack, more
    of them than the master keeps one by one, and one node another failure: each kept root
    cause is bounded with its error line, and the failures are answered as two records, the
    storm's counting every report and node; a restarted master and the state an ended job
    left answer the same."""
    store = SqliteStateStore(str(tmp_path / "state.db"))
    job = JobMaster(JobMasterConfig(job_name="j"), store)
    storm = 3 * MAX_FAILURES
    other = FailureRecord(5.5, "odd", FailureClass.OOM, "relaunch_node", "killed for memory")
    for i in range(storm):
        job.diagnostics.record_failure(
            FailureRecord(float(i), f"n{i}", FailureClass.EXIT_CODE, "restart_processes", _stack(i))
        )
        if i == 5:
            job.diagnostics.record_failure(other)
    kept = job.diagnostics.failures()
    assert len(kept) == MAX_FAILURES
    for record in kept:
        assert len(record.root_cause) <= MAX_CAUSE_CHARS + 100
        assert record.root_cause.endswith(
            f"NCCL error on rank {record.node_id[1:]}, pid {1000 + int(record.node_id[1:])}"
        )
        assert record.root_cause.startswith("worker rank")
    answered = job.diagnostics.get_failures()
    assert len(answered) == 2
    folded, odd = answered
    assert odd == other  # a failure of its own is answered as it was reported
    assert (folded.count, folded.node_count) == (storm, storm)
    assert (folded.first_at, folded.at, folded.node_id) == (0.0, storm - 1.0, f"n{storm - 1}")
    job.diagnostics.flush()
    again = JobMaster(JobMasterConfig(job_name="j"), store)  # a restarted master
    assert again.diagnostics.get_failures() == answered
    assert load_folded(store) == answered  # `dlrover diagnose` of the ended job
    store.close()


def test_failures_folded_before_a_round_formed_are_linked_to_it(tmp_path: Path) -> None:
    store = SqliteStateStore(str(tmp_path / "state.db"))
    job = JobMaster(JobMasterConfig(job_name="j"), store)
    for i in range(MAX_FAILURES + 10):
        job.diagnostics.record_failure(
            FailureRecord(float(i), f"n{i}", FailureClass.SIGNAL, "restart_processes", f"kill {i}")
        )
    job.diagnostics.link_round(4)
    (only,) = job.diagnostics.get_failures()
    assert (only.round, only.count) == (4, MAX_FAILURES + 10)
    store.close()


def test_a_collateral_failure_is_its_own_kind_on_the_timeline() -> None:
    """One worker killed, its peer on another node failing on the lost connection: one failure
    on the charts (the kill), whichever node reported first; the peer's is kept, as collateral."""
    job = JobMaster(JobMasterConfig(job_name="j"), MemoryStateStore())
    job.diagnostics.record_failure(
        FailureRecord(1.0, "n0", FailureClass.COLLATERAL, "restart_processes", "closed by peer")
    )
    job.diagnostics.record_failure(
        FailureRecord(1.1, "n1", FailureClass.SIGNAL, "restart_processes", "rank 1 SIGKILL")
    )
    kinds = [(kind, text.split(":")[0]) for _, kind, text in job.diagnostics.events]
    assert kinds == [("collateral", "n0"), ("failure", "n1")]
    assert len(job.diagnostics.failures()) == 2  # both kept for `dlrover diagnose`
