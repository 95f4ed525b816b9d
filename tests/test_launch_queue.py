"""The node controller hands launches to the engine no faster than the engine's API takes them
(issue 52's rack-loss storm): the job's first nodes and every replacement go through a bounded
queue, and a launch the engine refuses for now is handed over again instead of failing the job.
The engine is the in-memory one with a Kubernetes-like creation rate and launch latency."""

from __future__ import annotations

import time

import pytest

from dlrover.engines.base import FailureReason, LaunchManyError, NodeState
from dlrover.jobspec import job_spec_from_dict
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.launch_queue import LaunchQueue, LaunchQueueFullError
from dlrover.master.node_controller import NodeController
from dlrover.master.rendezvous import RendezvousConfig
from dlrover.master.state_store import MemoryStateStore
from dlrover.testing.fake_engine import FakeEngine


def _controller(engine: FakeEngine, nodes: int, silent_replace_s: float = 0.0) -> NodeController:
    spec = job_spec_from_dict(
        {"name": "rack", "entrypoint": "train.py", "nodes": nodes, "max_relaunches": 3}
    )
    job = JobMaster(JobMasterConfig("rack", RendezvousConfig(nodes, nodes)), MemoryStateStore())
    return NodeController(job, engine, spec, "127.0.0.1:1", "t", silent_replace_s=silent_replace_s)


def _step_until(controller: NodeController, done, deadline_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + deadline_s
    while not done():
        assert time.monotonic() < deadline, "the controller did not get there in time"
        controller.step(0.05)


def _max_in_any_second(times: list[float]) -> int:
    return max(sum(1 for u in times if t <= u < t + 1.0) for t in times)


def test_a_tenth_of_the_job_lost_at_once_is_replaced_at_the_engine_s_rate_without_a_refusal():
    rate, nodes = 100.0, 300
    engine = FakeEngine(launch_rate=rate, launch_latency=(0.05, 0.3))
    controller = _controller(engine, nodes)
    controller.start()  # the first second's worth now, the rest from the controller's loop
    assert 0 < len(engine.launched) <= rate
    _step_until(controller, lambda: len(engine.launched) == nodes)
    _step_until(
        controller,
        lambda: all(n.state is NodeState.RUNNING for n in engine.list_nodes()),
    )
    assert not controller.job.lifecycle.ended.is_set()

    lost = [f"rack-worker-{rank}-0" for rank in range(0, nodes, 10)]  # a rack: 30 at once
    failed_at = time.monotonic()
    for node_id in lost:
        engine.fail(node_id, FailureReason.NODE_LOST, message="the rack's switch went")
    _step_until(controller, lambda: len(engine.launched) == nodes + len(lost))
    handed_s = engine.accepted_at[-1] - failed_at

    assert engine.refused == 0  # never faster than the engine's API takes them
    assert _max_in_any_second(engine.accepted_at) <= 2 * rate  # one second's burst + a second
    replaced = sorted(s.node_id for s in engine.launched[nodes:])
    assert replaced == sorted(f"rack-worker-{rank}-1" for rank in range(0, nodes, 10))
    assert handed_s < 2.0, handed_s
    assert controller.launches.stats.handed == nodes + len(lost)
    assert len(controller.launches) == 0
    assert not controller.job.lifecycle.ended.is_set()


def test_launches_the_engine_refuses_for_now_are_handed_over_again():
    """Another client of the same API used this second's creations: the engine answers 429 to
    what the queue thought it could send; the launches wait and go again, the job goes on."""
    engine = FakeEngine(launch_rate=20.0)
    assert engine.bucket is not None
    engine.bucket.take(engine.bucket.available())  # someone else's launches took this second's
    queue = LaunchQueue(engine, capacity=10)
    specs = [_controller(FakeEngine(), 10).supervisor.current("worker", rank) for rank in range(10)]
    queue.put(specs)
    queue.put(specs[:3])  # queued once per node id
    assert len(queue) == 10
    first = queue.pump()
    assert len(first) < 10 and queue.stats.refused_for_now > 0
    deadline = time.monotonic() + 10
    while len(queue):
        assert time.monotonic() < deadline
        time.sleep(queue.next_due_s() or 0.0)
        queue.pump()
    assert sorted(s.node_id for s in engine.launched) == sorted(s.node_id for s in specs)
    assert queue.stats.handed == 10


def test_a_launch_that_fails_outright_still_fails_the_batch_and_the_queue_is_bounded():
    engine = FakeEngine()
    specs = [_controller(engine, 3).supervisor.current("worker", rank) for rank in range(3)]
    engine.fail_launch_of = {specs[1].node_id}
    queue = LaunchQueue(engine, capacity=3)
    queue.put(specs)
    with pytest.raises(LaunchManyError) as failed:
        queue.pump()
    assert [n.node_id for n in failed.value.launched] == [specs[0].node_id, specs[2].node_id]
    assert list(failed.value.failures) == [specs[1].node_id]
    queue.put(specs)
    with pytest.raises(LaunchQueueFullError, match="already wait for the engine"):
        queue.put([specs[0].replacement()])


def test_a_rack_lost_half_by_engine_events_half_by_silence_is_replaced_once_each():
    """A tenth of the job goes at once: the engine reports half (pods gone), the other half
    only go silent (their machines cut off: the engine still runs them). The job loses each
    once; every slot gets one replacement through the queue, the silent nodes are deleted (so
    they cannot come back beside their replacements), and a late engine event of an attempt
    already replaced changes nothing."""
    from dlrover.api.master import Registration

    rate, nodes = 100.0, 200
    engine = FakeEngine(launch_rate=rate, launch_latency=(0.02, 0.2))
    controller = _controller(engine, nodes)
    job = controller.job
    engine.on_running = lambda spec: job.members.register_node(
        Registration(host="10.0.0.1", local_world_size=1, node_id=spec.node_id)
    )
    controller.start()
    _step_until(controller, lambda: len(engine.launched) == nodes)
    _step_until(controller, lambda: all(n.state is NodeState.RUNNING for n in engine.list_nodes()))

    rack = [f"rack-worker-{rank}-0" for rank in range(0, nodes, 10)]
    reported, silent = rack[::2], rack[1::2]
    failed_at = time.monotonic()
    for node_id in reported:
        engine.fail(node_id, FailureReason.NODE_LOST, message="pod deleted")
    for node_id in silent:
        job.members.lose(node_id, "no heartbeat for 30.0s", silent=True)
    _step_until(controller, lambda: len(engine.launched) == nodes + len(rack))
    handed_s = engine.accepted_at[-1] - failed_at
    _step_until(controller, lambda: set(silent) <= set(engine.deleted))
    for node_id in silent:  # the cut-off machines' pods end later: nothing more is launched
        engine.fail(node_id, FailureReason.NODE_LOST, message="pod gone at last")
    controller.step(0.2)

    replaced = sorted(s.node_id for s in engine.launched[nodes:])
    assert replaced == sorted(n.rsplit("-", 1)[0] + "-1" for n in rack)
    assert len(engine.launched) == nodes + len(rack)
    assert handed_s < 2.0, handed_s
    assert engine.refused == 0
    losses = [f for f in job.diagnostics.failures() if f.node_id in rack]
    assert sorted(f.node_id for f in losses) == sorted(rack)  # each recorded once
    assert not job.lifecycle.ended.is_set()


def test_a_silent_node_heard_again_within_the_grace_is_kept():
    """Silence is not death: a node dropped from the round for missing heartbeats (a loaded
    machine, a network blip) that registers again within DLROVER_SILENT_REPLACE_S is neither
    deleted nor replaced."""
    from dlrover.api.master import Registration

    engine = FakeEngine()
    controller = _controller(engine, 2, silent_replace_s=0.5)
    job = controller.job
    controller.start()
    for spec in engine.launched:
        engine.run(spec.node_id)
        job.members.register_node(Registration(host="h", local_world_size=1, node_id=spec.node_id))
    job.members.lose("rack-worker-1-0", "no heartbeat for 6.0s", silent=True)
    job.members.register_node(Registration(host="h", local_world_size=1, node_id="rack-worker-1-0"))
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        controller.step(0.05)
    assert [s.node_id for s in engine.launched] == ["rack-worker-0-0", "rack-worker-1-0"]
    assert engine.deleted == []
