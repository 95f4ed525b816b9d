"""A job's failure names its root cause across nodes: a healthy node's collateral error (its
peer went away) is never chosen while another node's own failure of the same round exists,
whatever order the reports arrive in; the same root cause twice in a row fails the job fast,
whichever node raised it. Real master parts, reports as the agents send them."""

from __future__ import annotations

import pytest

from dlrover.api.master import FailureClass, FailureRecord, NodeOutcome, NodeReport, Registration
from dlrover.master import lifecycle
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.lifecycle import JobState
from dlrover.master.rendezvous import RendezvousConfig
from dlrover.master.state_store import MemoryStateStore

COLLATERAL_CAUSE = "rank 0 exit code 1: RuntimeError: [pair.cc:553] Connection closed by peer"
USER_CAUSE = "rank 1 exit code 1: ValueError: bad learning rate"
SIGNATURE = "ValueError at train.py:42 in step"


def _job() -> JobMaster:
    job = JobMaster(JobMasterConfig("rc", RendezvousConfig(1, 3)), MemoryStateStore())
    for node in ("a", "b", "c"):
        job.members.register_node(Registration("h", 1, node, "default", -1, 1))
    return job


def _collateral(job: JobMaster, node: str, action: str = "restart_processes") -> None:
    job.diagnostics.report_failure(
        node, 0, FailureRecord(1.0, node, FailureClass.COLLATERAL, action, COLLATERAL_CAUSE)
    )


def _user_error(job: JobMaster, node: str, action: str = "restart_processes") -> None:
    job.diagnostics.report_failure(
        node,
        0,
        FailureRecord(2.0, node, FailureClass.USER_ERROR, action, USER_CAUSE, signature=SIGNATURE),
    )


def _node_fails(job: JobMaster, node: str) -> None:
    reason = f"restart budget exhausted (3/3); {COLLATERAL_CAUSE}"
    job.lifecycle.report_now(NodeReport(node, 0, NodeOutcome.FAILED, 1, reason))


def test_a_collateral_failure_waits_for_the_root_cause_reported_after_it() -> None:
    job = _job()
    _collateral(job, "a")
    _node_fails(job, "a")  # a's budget ran out on its peer's error: not the cause
    assert not job.lifecycle.ended.is_set()
    _collateral(job, "c")
    assert not job.lifecycle.ended.is_set()
    _user_error(job, "b")  # the cause, reported last
    assert job.lifecycle.state is JobState.FAILED
    assert job.lifecycle.reason.endswith(f"root cause: node b: {USER_CAUSE}"), job.lifecycle.reason


def test_a_root_cause_reported_before_the_collateral_failure_is_named_at_once() -> None:
    job = _job()
    _user_error(job, "b")
    _collateral(job, "a")
    _node_fails(job, "a")
    assert job.lifecycle.state is JobState.FAILED
    assert f"root cause: node b: {USER_CAUSE}" in job.lifecycle.reason


def test_a_node_failing_on_its_own_error_fails_the_job_at_once() -> None:
    job = _job()
    _user_error(job, "b", action="fail")
    job.lifecycle.report_now(NodeReport("b", 0, NodeOutcome.FAILED, 1, "same user error twice"))
    assert job.lifecycle.state is JobState.FAILED
    assert "root cause" not in job.lifecycle.reason  # its own reason is the cause


def test_without_a_root_cause_the_held_failure_ends_after_its_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(lifecycle.time, "monotonic", lambda: now[0])
    job = _job()
    _collateral(job, "a")
    _node_fails(job, "a")
    job.lifecycle.check_end()
    assert not job.lifecycle.ended.is_set()
    now[0] += lifecycle.ROOT_CAUSE_WAIT_S
    job.lifecycle.check_end()  # the tick
    assert job.lifecycle.state is JobState.FAILED
    assert "no other node reported its own failure" in job.lifecycle.reason


def test_the_same_root_cause_twice_in_a_row_fails_fast_whichever_node_raised_it() -> None:
    job = _job()
    _user_error(job, "b")
    _collateral(job, "a")
    job.diagnostics.link_round(2)  # the failures led to round 2
    _collateral(job, "a")  # round 2: the collateral errors come first ...
    assert not job.lifecycle.ended.is_set()
    _user_error(job, "c")  # ... then the same error, now on node c
    assert job.lifecycle.state is JobState.FAILED
    reason = job.lifecycle.reason
    assert reason.startswith(f"same root cause twice in a row ({SIGNATURE}): failing fast")
    assert "node c" in reason and "before on node b" in reason


def test_another_error_or_a_collateral_one_is_no_repeat() -> None:
    job = _job()
    _user_error(job, "b")
    job.diagnostics.link_round(2)
    job.diagnostics.report_failure(
        "b",
        0,
        FailureRecord(
            3.0, "b", FailureClass.USER_ERROR, "restart_processes", "rank 1: KeyError: 'x'",
            signature="KeyError at train.py:7 in load",
        ),
    )  # fmt: skip
    job.diagnostics.link_round(3)
    _collateral(job, "a")
    assert not job.lifecycle.ended.is_set()
