"""The master's parts: one way to lose a node, one relaunch rule, role controllers by role."""

from __future__ import annotations

import pytest

from dlrover.api.master import (
    FailureClass,
    HeartbeatReport,
    JoinRequest,
    NodeCheckJoin,
    NodeCheckReport,
    NodeOutcome,
    NodeReport,
    Registration,
)
from dlrover.decisions import FailureAction
from dlrover.engines.base import FailureReason, NodeEvent, NodeSpec, NodeState, Resources
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.node_policy import NodeLossReason
from dlrover.master.relaunch_policy import OomPolicy, RelaunchPolicy
from dlrover.master.rendezvous import RendezvousConfig
from dlrover.master.state_store import MemoryStateStore


def _running_pair(now: list[float]) -> JobMaster:
    """A two-node job whose round closed, with step times observed for both nodes."""
    job = JobMaster(
        JobMasterConfig("parts", RendezvousConfig(2, 2), heartbeat_timeout_s=10.0),
        MemoryStateStore(),
        clock=lambda: now[0],
    )
    for node in ("a", "b"):
        job.members.register_node(Registration("h", 1, node, "worker", -1, 1))
        job.members.join_rendezvous(JoinRequest(node, 0, 1, "h", 1))
    assert job.members.get_world("a", 0) is not None
    for node in ("a", "b"):
        job.members.heartbeat(
            HeartbeatReport(
                node, 0, cpu_percent=0.0, memory_bytes=0, step=1, restart_count=0, step_time_s=0.1
            )
        )
    return job


def _scored(job: JobMaster) -> list[str]:
    """The nodes a straggler report would score now (those with a step time on record)."""
    scores, _ = job.diagnostics.stragglers.report(["a", "b"])
    return [s.node_id for s in scores]


@pytest.mark.parametrize("how", ["heartbeat", "engine"])
def test_a_lost_node_is_forgotten_the_same_way_whoever_noticed(how: str) -> None:
    now = [0.0]
    job = _running_pair(now)
    assert _scored(job) == ["a", "b"]
    job.members.expect("b")  # as if a controller had announced a replacement under that id
    rounds = job.rendezvous
    assert rounds is not None and rounds.world is not None
    if how == "heartbeat":
        now[0] += 11.0
        job.members.heartbeat(
            HeartbeatReport("a", 0, cpu_percent=0.0, memory_bytes=0, step=2, restart_count=0)
        )  # only a beats
        job.tick()
    else:
        job.members.lose("b", "process_exited: killed")
    node = job.members.nodes.get("b")
    assert node.state.value == "lost"
    # Every departure forgets the same things: the straggler history, the expected set.
    assert _scored(job) == ["a"]
    assert not job.members.expecting()
    # and what it records depends on who noticed, as before: a silent node is a failure.
    kinds = [kind for _, kind, _ in job.diagnostics.events]
    if how == "heartbeat":
        assert [f.failure_class for f in job.diagnostics.failures()] == [FailureClass.NODE_LOST]
        assert "node" not in kinds
    else:
        assert job.diagnostics.failures() == ()
        assert "node" in kinds


def _event(reason: FailureReason, relaunch_count: int, memory_mib: int = 1000) -> NodeEvent:
    spec = NodeSpec(
        "j",
        0,
        ("dlrover-ps",),
        role="ps",
        relaunch_count=relaunch_count,
        resources=Resources(memory_mib=memory_mib),
    )
    return NodeEvent(spec.node_id, spec, NodeState.FAILED, reason=reason)


def test_one_relaunch_rule_for_roles_without_survivors() -> None:
    policy = RelaunchPolicy(2, OomPolicy(factor=1.5, max_memory_mib=1400))
    actions = [policy.decide("n", NodeLossReason.PROCESS_EXITED, used).action for used in range(4)]
    assert actions == [
        FailureAction.RELAUNCH_NODE,
        FailureAction.RELAUNCH_NODE,
        FailureAction.FAIL,
        FailureAction.FAIL,
    ]
    grown = policy.replacement(_event(FailureReason.OOM_KILLED, 0))
    assert grown is not None and grown.resources.memory_mib == 1400  # 1.5x, capped
    assert policy.replacement(_event(FailureReason.OOM_KILLED, 1, memory_mib=1400)) is None
    same = policy.replacement(_event(FailureReason.SIGNAL, 0))
    assert same is not None and same.resources.memory_mib == 1000
    assert policy.loss_reason(_event(FailureReason.OOM_KILLED, 0)) is NodeLossReason.OOM_KILLED


def test_scale_requests_go_to_the_controller_registered_for_the_role() -> None:
    job = JobMaster(JobMasterConfig("roles"), MemoryStateStore())
    with pytest.raises(ValueError, match="no embedding servers"):
        job.roles.scale_role("ps", 2)
    with pytest.raises(ValueError, match="only ps"):
        job.roles.scale_role("worker", 2)

    class Servers:
        failovers = 0

        def on_event(self, event: NodeEvent) -> None:
            """Unused here."""

        def request_scale(self, role: str, count: int) -> tuple[str, int]:
            return f"{role} -> {count}", 7

        def stats(self) -> list[object]:
            return []

    servers = Servers()
    job.roles.register("ps", servers)
    assert job.roles.owner("ps") is servers
    assert job.roles.scale_role("ps", 3) == ("ps -> 3", 7)
    job.roles.register_job(servers)  # a TensorFlow job's controller answers for every role
    assert job.roles.scale_role("chief", 1) == ("chief -> 1", 7)


@pytest.mark.parametrize("exclude", [False, True])
def test_a_straggler_the_node_check_names_is_recorded_whether_excluded_or_kept(
    exclude: bool,
) -> None:
    """`dlrover diagnose` reads `failures()`: a node the check found 3x slow is there with the
    action taken (exclude, or none when the job keeps it)."""
    now = [0.0]
    job = _running_pair(now)
    world = job.members.get_world("a", 0)
    assert world is not None
    for node in ("a", "b"):
        job.preflight.node_check_poll(
            NodeCheckJoin(node, 0, world.round, 1, f"h:{node}", 2.0, exclude)
        )
    for node, compute_s in (("a", 1.0), ("b", 3.0)):
        job.preflight.report_node_check(
            NodeCheckReport(node, 0, world.round, 1, True, compute_s, 0.1)
        )
    [record] = job.diagnostics.failures()
    assert (record.node_id, record.failure_class) == ("b", FailureClass.STRAGGLER)
    assert record.action == ("exclude" if exclude else "none")
    assert record.root_cause.startswith("node check: 3.0x the median check time")
    assert exclude or record.root_cause.endswith("kept (no --exclude-straggler)")


def test_a_runtime_straggler_the_job_keeps_is_recorded() -> None:
    """Without --exclude-straggler, a node scoring low in three reports in a row is recorded
    (action none); with it, the node controller records the replacement it makes."""
    now = [0.0]
    job = _running_pair(now)
    for _ in range(3):
        now[0] += job.diagnostics.stragglers.report_s
        job.members.heartbeat(
            HeartbeatReport(
                "a", 0, cpu_percent=0.0, memory_bytes=0, step=1, restart_count=0, step_time_s=0.1
            )
        )
        job.members.heartbeat(
            HeartbeatReport(
                "b", 0, cpu_percent=0.0, memory_bytes=0, step=1, restart_count=0, step_time_s=0.4
            )
        )
        job.tick()
    [record] = job.diagnostics.failures()
    assert (record.node_id, record.failure_class, record.action) == (
        "b",
        FailureClass.STRAGGLER,
        "none",
    )
    assert "runtime score 0.25 of the fastest node in 3 reports" in record.root_cause


def test_no_straggler_is_replaced_once_a_node_of_the_round_succeeded() -> None:
    """Three nodes, c 4x slow: with --exclude-straggler it would be replaced at the third
    report; but a succeeded before it, so the round is finishing and a replacement could never
    rejoin it (seen in CI: the replaced node's new round could not form and the job failed)."""
    now = [0.0]
    job = JobMaster(
        JobMasterConfig("trio", RendezvousConfig(3, 3), 10.0, exclude_stragglers=True),
        MemoryStateStore(),
        clock=lambda: now[0],
    )
    for node in ("a", "b", "c"):
        job.members.register_node(Registration("h", 1, node, "worker", -1, 1))
        job.members.join_rendezvous(JoinRequest(node, 0, 1, "h", 1))
    assert job.members.get_world("a", 0) is not None
    for report in range(3):
        if report == 2:
            assert not job.lifecycle.report_now(NodeReport("a", 1, NodeOutcome.SUCCEEDED, 0, ""))
        now[0] += job.diagnostics.stragglers.report_s
        for node, step_s in (("a", 0.1), ("b", 0.1), ("c", 0.4)):
            job.members.heartbeat(
                HeartbeatReport(
                    node,
                    0,
                    cpu_percent=0.0,
                    memory_bytes=0,
                    step=1,
                    restart_count=0,
                    step_time_s=step_s,
                )
            )
        job.tick()
    assert job.diagnostics.take_replacements() == [] and job.diagnostics.failures() == ()
    assert not job.lifecycle.ended.is_set()  # b and c finish the round


@pytest.mark.parametrize("order", ["succeeded, then restarted", "restarted, then succeeded"])
def test_a_round_no_one_can_join_after_others_succeeded_fails_the_job(order: str) -> None:
    """A node restarting its workers (a hang) after the other node's workers exited 0 waits for
    a round the succeeded node never joins: the job fails saying so instead of waiting."""
    job = _running_pair([0.0])
    if order.startswith("succeeded"):
        assert not job.lifecycle.report_now(NodeReport("a", 1, NodeOutcome.SUCCEEDED, 0, ""))
        assert not job.lifecycle.ended.is_set()  # b may still succeed
        job.members.join_rendezvous(JoinRequest("b", 0, 1, "h", 1))
    else:
        job.members.join_rendezvous(JoinRequest("b", 0, 1, "h", 1))
        assert not job.lifecycle.ended.is_set()  # a may still re-form with it
        job.lifecycle.report_now(NodeReport("a", 1, NodeOutcome.SUCCEEDED, 0, ""))
    assert (
        job.lifecycle.ended.is_set()
        and job.lifecycle.state.value == "failed"
        and job.lifecycle.exit_code == 1
    )
    assert job.lifecycle.reason.startswith(
        "rendezvous round 2 can never form: b restarted its workers after a succeeded"
    )
    assert "it needs 2 nodes of which 1 can join" in job.lifecycle.reason


def test_a_round_the_alive_nodes_can_fill_is_waited_for_after_a_node_succeeded() -> None:
    """With min 1 the restarted node forms a round alone; a replacement on its way may fill it."""
    job = JobMaster(
        JobMasterConfig("parts", RendezvousConfig(1, 2), heartbeat_timeout_s=10.0),
        MemoryStateStore(),
        clock=lambda: 0.0,
    )
    for node in ("a", "b"):
        job.members.register_node(Registration("h", 1, node, "worker", -1, 1))
        job.members.join_rendezvous(JoinRequest(node, 0, 1, "h", 1))
    assert job.members.get_world("a", 0) is not None
    job.lifecycle.report_now(NodeReport("a", 1, NodeOutcome.SUCCEEDED, 0, ""))
    job.members.join_rendezvous(JoinRequest("b", 0, 1, "h", 1))
    assert not job.lifecycle.ended.is_set()


def test_a_failure_is_linked_to_the_round_it_led_to_in_the_state_too() -> None:
    """A worker failure recorded while round 1 runs is linked to round 2, which its restart
    forms; a failure after round 2 waits for the next round; a restarted master reads the links
    from the state."""
    from dlrover.api.master import FailureRecord
    from dlrover.master.diagnosis import load_failures

    store = MemoryStateStore()
    job = JobMaster(JobMasterConfig("parts", RendezvousConfig(2, 2)), store)
    for node in ("a", "b"):
        job.members.register_node(Registration("h", 1, node, "worker", -1, 1))
        job.members.join_rendezvous(JoinRequest(node, 0, 1, "h", 1))
    assert job.members.get_world("a", 0).round == 1  # type: ignore[union-attr]
    first = FailureRecord(1.0, "b", FailureClass.SIGNAL, "restart_processes", "rank 1 killed")
    job.diagnostics.report_failure("b", 0, first)
    assert [f.round for f in job.diagnostics.failures()] == [0]
    for node in ("b", "a"):  # b restarts its workers, a re-forms with it
        job.members.join_rendezvous(JoinRequest(node, 0, 1, "h", 1))
    assert job.members.get_world("a", 0).round == 2  # type: ignore[union-attr]
    later = FailureRecord(2.0, "a", FailureClass.USER_ERROR, "restart_processes", "ValueError")
    job.diagnostics.report_failure("a", 0, later)
    assert [(f.node_id, f.round) for f in job.diagnostics.failures()] == [("b", 2), ("a", 0)]
    assert [(r.node_id, r.round) for _, r in load_failures(store)] == [("b", 2), ("a", 0)]
    again = JobMaster(JobMasterConfig("parts", RendezvousConfig(2, 2)), store)
    assert [(f.node_id, f.round) for f in again.diagnostics.failures()] == [("b", 2), ("a", 0)]
