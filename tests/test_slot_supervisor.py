"""The one slot supervisor: per slot, one relaunch count and one OOM history whichever role asks;
attempts launched by plan do not use the budget; each failure is recorded once; a supervisor
restarted on its state knows every slot's attempt."""

from __future__ import annotations

from pathlib import Path

from dlrover.api.master import FailureClass, FailureRecord
from dlrover.decisions import FailureAction
from dlrover.engines.base import FailureReason, NodeEvent, NodeSpec, NodeState, Resources
from dlrover.master.relaunch_policy import OomPolicy, RelaunchPolicy
from dlrover.master.slot_supervisor import SlotSupervisor
from dlrover.master.state_store import SqliteStateStore, StateStore


class Log:
    def __init__(self) -> None:
        self.records: list[FailureRecord] = []

    def record_failure(self, record: FailureRecord) -> None:
        self.records.append(record)


def _build(role: str):  # type: ignore[no-untyped-def]
    def build(index: int, attempt: int) -> NodeSpec:
        return NodeSpec("j", index, ("true",), role, attempt, resources=Resources(memory_mib=1000))

    return build


def _supervisor(
    store: StateStore | None = None, max_relaunches: int = 2
) -> tuple[SlotSupervisor, Log]:
    log = Log()
    policy = RelaunchPolicy(max_relaunches, OomPolicy(factor=1.5, max_memory_mib=2000))
    supervisor = SlotSupervisor(log, policy, store)
    for role in ("worker", "ps"):
        supervisor.role(role, _build(role))
    return supervisor, log


def _failed(spec: NodeSpec, reason: FailureReason = FailureReason.EXIT_CODE) -> NodeEvent:
    return NodeEvent(spec.node_id, spec, NodeState.FAILED, reason, message="boom")


def test_each_failure_uses_one_relaunch_is_recorded_once_and_the_last_one_fails() -> None:
    supervisor, log = _supervisor()
    spec = supervisor.current("worker", 0)
    attempts = [spec.node_id]
    for _ in range(2):
        verdict = supervisor.judge(_failed(spec), label="worker")
        assert verdict.action is FailureAction.RELAUNCH_NODE and verdict.replacement is not None
        spec = verdict.replacement
        attempts.append(spec.node_id)
    last = supervisor.judge(_failed(spec))
    assert last.action is FailureAction.FAIL and last.replacement is None
    assert attempts == ["j-worker-0-0", "j-worker-0-1", "j-worker-0-2"]
    assert [(r.node_id, r.action) for r in log.records] == [
        ("j-worker-0-0", "relaunch_node"),
        ("j-worker-0-1", "relaunch_node"),
        ("j-worker-0-2", "fail"),
    ]
    assert log.records[0].root_cause == "worker: boom"
    assert supervisor.used("worker", 0) == 2 and supervisor.used("ps", 0) == 0


def test_oom_kills_grow_the_next_attempt_until_the_cap_and_keep_their_history() -> None:
    supervisor, log = _supervisor(max_relaunches=5)
    spec = supervisor.current("ps", 1)
    grown = []
    while True:
        verdict = supervisor.judge(_failed(spec, FailureReason.OOM_KILLED))
        if verdict.replacement is None:
            break
        spec = verdict.replacement
        grown.append(spec.resources.memory_mib)
    assert grown == [1500, 2000]
    assert verdict.action is FailureAction.FAIL and verdict.cannot_grow
    assert "cannot grow: the memory cap is 2000 MiB" in verdict.reason
    assert verdict.oom_kills == (1000, 1500, 2000)
    assert [r.failure_class for r in log.records] == [FailureClass.OOM] * 3


def test_planned_attempts_do_not_use_the_budget_and_a_straggler_does() -> None:
    supervisor, log = _supervisor(max_relaunches=1)
    spec = supervisor.current("worker", 0)
    for memory in (2000, 3000, 4000):  # three resizes
        resized = supervisor.replace(spec, Resources(memory_mib=memory))
        assert resized is not None and resized.resources.memory_mib == memory
        spec = resized
    assert spec.node_id == "j-worker-0-3" and supervisor.used("worker", 0) == 0 and not log.records
    straggler = supervisor.replace(spec, failure=(FailureClass.STRAGGLER, "slow"))
    assert straggler is not None and straggler.node_id == "j-worker-0-4"
    assert straggler.resources.memory_mib == 4000
    assert supervisor.replace(straggler, failure=(FailureClass.STRAGGLER, "slow")) is None
    assert [(r.node_id, r.failure_class) for r in log.records] == [
        ("j-worker-0-3", FailureClass.STRAGGLER)
    ]


def test_a_slot_opened_again_gets_a_new_attempt_and_keeps_its_failures() -> None:
    supervisor, _ = _supervisor(max_relaunches=1)
    first = supervisor.open("ps", 2)
    assert first.node_id == "j-ps-2-0"
    verdict = supervisor.judge(_failed(first, FailureReason.OOM_KILLED))
    assert verdict.replacement is not None and verdict.replacement.resources.memory_mib == 1500
    again = supervisor.open("ps", 2)  # scaled in, then out again
    assert again.node_id == "j-ps-2-2" and again.resources.memory_mib == 1000  # the role's size
    assert supervisor.judge(_failed(again)).action is FailureAction.FAIL  # its one relaunch used


def test_a_supervisor_restarted_on_its_state_resumes_every_slots_attempt(tmp_path: Path) -> None:
    store = SqliteStateStore(str(tmp_path / "state.db"))
    supervisor, _ = _supervisor(store)
    worker = supervisor.current("worker", 0)
    verdict = supervisor.judge(_failed(worker, FailureReason.OOM_KILLED))
    assert verdict.replacement is not None
    supervisor.replace(supervisor.current("ps", 0), Resources(memory_mib=700))
    store.close()

    again, _ = _supervisor(SqliteStateStore(str(tmp_path / "state.db")))
    assert again.current("worker", 0) == verdict.replacement
    assert again.current("ps", 0).node_id == "j-ps-0-1"
    assert again.current("ps", 0).resources.memory_mib == 700
    record = again.record("worker", 0)
    assert record is not None and record.oom_kills == [1000] and record.used == 1
    # The planned resize is remembered: the ps slot still has both relaunches.
    ps = again.current("ps", 0)
    assert again.judge(_failed(ps)).action is FailureAction.RELAUNCH_NODE
    assert again.used("ps", 0) == 1


def test_a_failure_recorded_elsewhere_is_not_recorded_twice() -> None:
    supervisor, log = _supervisor()
    verdict = supervisor.judge(_failed(supervisor.current("worker", 3)), record=False)
    assert verdict.action is FailureAction.RELAUNCH_NODE and not log.records


def test_a_fresh_slot_opened_again_has_its_whole_budget_and_no_oom_history() -> None:
    supervisor, _ = _supervisor(max_relaunches=1)
    first = supervisor.open("worker", 1)
    verdict = supervisor.judge(_failed(first, FailureReason.OOM_KILLED))
    assert verdict.replacement is not None
    again = supervisor.open("worker", 1, fresh=True)  # a TensorFlow worker slot used again
    assert again.node_id == "j-worker-1-2" and supervisor.used("worker", 1) == 0
    last = supervisor.judge(_failed(again))
    assert last.action is FailureAction.RELAUNCH_NODE and last.oom_kills == ()


def test_a_program_that_cannot_start_fails_its_slot_at_once_with_its_cause() -> None:
    """Exit code 127 (CANNOT_START_EXIT_CODE): no relaunch cures it, whatever budget is left;
    the record names the cause and counts as the user's error."""
    supervisor, log = _supervisor()
    spec = supervisor.current("worker", 0)
    event = NodeEvent(
        spec.node_id, spec, NodeState.FAILED, FailureReason.EXIT_CODE, exit_code=127,
        message="exited with code 127",
    )  # fmt: skip
    verdict = supervisor.judge(event, label="chief", cause="`python -m nope`: no module 'nope'")
    assert verdict.action is FailureAction.FAIL and verdict.replacement is None
    assert verdict.reason == (
        "chief 0 (j-worker-0-0) cannot start its program: `python -m nope`: no module 'nope'; "
        "not relaunched: fix the command"
    )
    assert [(r.failure_class.value, r.action) for r in log.records] == [("user_error", "fail")]
    assert log.records[0].root_cause == "chief: `python -m nope`: no module 'nope'"
    assert supervisor.used("worker", 0) == 0
