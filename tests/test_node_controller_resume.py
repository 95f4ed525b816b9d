"""A master restarted on its state (a master pod's container restarted on its volume) launches
each slot's current node attempt again, so the engine adopts the running nodes instead of the
job getting a second copy of a slot or losing a replacement's larger memory."""

from __future__ import annotations

from pathlib import Path

from dlrover.api.master import Registration
from dlrover.engines.base import FailureReason
from dlrover.jobspec import job_spec_from_dict
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.node_controller import NodeController
from dlrover.master.rendezvous import RendezvousConfig
from dlrover.master.state_store import SqliteStateStore
from dlrover.testing.fake_engine import FakeEngine


def _controller(store: SqliteStateStore, engine: FakeEngine) -> NodeController:
    spec = job_spec_from_dict(
        {
            "name": "resume",
            "entrypoint": "train.py",
            "nodes": 2,
            "resources": {"memory": "1Gi"},
            "max_relaunches": 3,
        }
    )
    job = JobMaster(JobMasterConfig("resume", RendezvousConfig(2, 2)), store)
    return NodeController(job, engine, spec, "127.0.0.1:1", "t", store=store)


def test_a_restarted_master_relaunches_the_same_attempt_of_every_slot(tmp_path: Path):
    store = SqliteStateStore(str(tmp_path / "state.db"))
    first = FakeEngine()
    controller = _controller(store, first)
    controller.start()
    assert [s.node_id for s in first.launched] == ["resume-worker-0-0", "resume-worker-1-0"]
    first.fail("resume-worker-1-0", FailureReason.OOM_KILLED)
    controller.step(5.0)
    replacement = first.launched[-1]
    assert replacement.node_id == "resume-worker-1-1"
    assert replacement.resources.memory_mib > 1024  # an OOM kill grows the next attempt

    # The master dies (its nodes keep running) and comes back on the same state.
    store.close()
    store = SqliteStateStore(str(tmp_path / "state.db"))
    again = FakeEngine()
    _controller(store, again).start()
    assert [s.node_id for s in again.launched] == ["resume-worker-0-0", "resume-worker-1-1"]
    assert again.launched[1].resources == replacement.resources


def test_a_master_restarted_after_the_jobs_end_exits_0_without_launching(
    tmp_path: Path, monkeypatch, capsys
):
    """The master pod restarts its container on failure (OnFailure): after a failed job the
    restarted master finds the end in its state and exits 0 instead of looping."""
    from dlrover.cli.serve_job import serve_job
    from dlrover.master.assembly import claim_state

    monkeypatch.setenv("DLROVER_HOME", str(tmp_path / "home"))
    db = str(tmp_path / "state.db")
    store = SqliteStateStore(db)
    claim_state(store, "ended", "tok")
    JobMaster(JobMasterConfig("ended", RendezvousConfig(1, 1)), store).lifecycle.stop(
        "a node failed"
    )
    store.close()
    spec = job_spec_from_dict({"name": "ended", "entrypoint": "train.py", "nodes": 1})
    assert serve_job(spec, "127.0.0.1", 0, token="tok", state=db) == 0
    assert "already failed (a node failed); nothing to serve" in capsys.readouterr().err
    assert not (tmp_path / "home" / "jobs" / "ended" / "nodes").exists()  # nothing launched


def test_a_one_node_job_is_not_failed_while_its_replacement_is_on_its_way(tmp_path: Path):
    """Its only node is lost: until the replacement registers (or is lost too), the master's
    tick must not fail the job as "every node was lost"; once no replacement is left, it does."""
    from dlrover.api.master import FailureClass
    from dlrover.master.state_store import MemoryStateStore

    spec = job_spec_from_dict(
        {"name": "one", "entrypoint": "t.py", "nodes": 1, "max_relaunches": 1}
    )
    job = JobMaster(JobMasterConfig("one", RendezvousConfig(1, 1)), MemoryStateStore())
    engine = FakeEngine()
    controller = NodeController(job, engine, spec, "127.0.0.1:1", "t")
    controller.start()
    job.members.register_node(Registration("h", 1, "one-worker-0-0", "default", -1, 1))
    engine.fail("one-worker-0-0", FailureReason.SIGNAL)
    controller.step(5.0)
    job.tick()
    assert not job.lifecycle.ended.is_set(), job.lifecycle.reason  # one-worker-0-1 is expected
    assert engine.launched[-1].node_id == "one-worker-0-1"
    engine.fail("one-worker-0-1", FailureReason.NODE_LOST)  # lost before it registered
    controller.step(5.0)
    assert job.lifecycle.ended.is_set() and "no relaunch left" in job.lifecycle.reason
    assert [f.failure_class for f in job.diagnostics.failures()] == [
        FailureClass.SIGNAL,
        FailureClass.NODE_LOST,
    ]


def _scaling(store: SqliteStateStore, engine: FakeEngine) -> NodeController:
    from dlrover.master.autoscaler import AutoScaler
    from dlrover.master.optimizer import OptimizerConfig

    spec = job_spec_from_dict(
        {"name": "el", "entrypoint": "train.py", "nodes": "1:3", "max_relaunches": 3}
    )
    job = JobMaster(JobMasterConfig("el", RendezvousConfig(1, 3)), store)
    controller = NodeController(job, engine, spec, "127.0.0.1:1", "t", store=store)
    controller.scaler = AutoScaler(job, controller, OptimizerConfig(1, 3))
    return controller


def test_scaling_starts_at_min_nodes_and_moves_slots_within_min_max(tmp_path: Path):
    """With a horizontal auto-scaler the job starts at MIN nodes; scaling out launches the next
    slots, scaling in deletes the highest ones, and a slot used again gets a new attempt."""
    store = SqliteStateStore(str(tmp_path / "state.db"))
    engine = FakeEngine()
    controller = _scaling(store, engine)
    controller.start()
    assert [s.node_id for s in engine.launched] == ["el-worker-0-0"]
    controller.scale_to(3, "test")
    assert [s.node_id for s in engine.launched[1:]] == ["el-worker-1-0", "el-worker-2-0"]
    controller.scale_to(2, "test")
    live = sorted(n.node_id for n in engine.list_nodes() if not n.state.is_final)
    assert live == ["el-worker-0-0", "el-worker-1-0"]
    controller.scale_to(9, "beyond max")  # clamped to MAX; slot 2 comes back as its next attempt
    assert engine.launched[-1].node_id == "el-worker-2-1" and controller.slots == 3
    engine.fail("el-worker-2-1")  # it dies, and the job is scaled in before the event is seen
    controller.scale_to(2, "test")
    controller.step(0.1)
    assert engine.launched[-1].node_id == "el-worker-2-1"  # a retired slot is not relaunched

    # A master restarted on the state launches as many slots as its predecessor used.
    store.close()
    store = SqliteStateStore(str(tmp_path / "state.db"))
    again = FakeEngine()
    _scaling(store, again).start()
    assert [s.node_id for s in again.launched] == ["el-worker-0-0", "el-worker-1-0"]


def test_resizes_do_not_use_up_the_relaunch_budget(tmp_path: Path):
    """A slot relaunched by the auto-scaler (a resize) keeps every relaunch for failures; the
    count survives a master restart."""
    from dlrover.engines.base import Resources

    store = SqliteStateStore(str(tmp_path / "state.db"))
    spec = job_spec_from_dict({"name": "rb", "entrypoint": "t.py", "nodes": 1, "max_relaunches": 1})
    job = JobMaster(JobMasterConfig("rb", RendezvousConfig(1, 1)), store)
    engine = FakeEngine()
    controller = NodeController(job, engine, spec, "127.0.0.1:1", "t", store=store)
    controller.start()
    controller.resize(Resources(cpu=1, memory_mib=512), "test")
    controller.step(0.1)
    controller.resize(Resources(cpu=1, memory_mib=1024), "test")
    controller.step(0.1)
    assert engine.launched[-1].node_id == "rb-worker-0-2"
    engine.fail("rb-worker-0-2")
    controller.step(0.1)
    assert engine.launched[-1].node_id == "rb-worker-0-3"  # its one relaunch for a failure
    assert not job.lifecycle.ended.is_set()

    store.close()  # a restarted master still knows two of the slot's attempts were planned
    store = SqliteStateStore(str(tmp_path / "state.db"))
    job = JobMaster(JobMasterConfig("rb", RendezvousConfig(1, 1)), store)
    again = FakeEngine()
    controller = NodeController(job, again, spec, "127.0.0.1:1", "t", store=store)
    controller.start()
    again.fail("rb-worker-0-3")
    controller.step(0.1)
    assert job.lifecycle.ended.is_set() and "no relaunch left (1)" in job.lifecycle.reason, (
        job.lifecycle.reason
    )


def _lose_all(job: JobMaster, node_ids: list[str]) -> None:
    """Register each node, lose it, and tick: the job fails unless a replacement is expected."""
    for node_id in node_ids:
        job.members.register_node(Registration("h", 1, node_id, "default", -1, 1))
        job.members.lose(node_id, "gone")
    job.tick()


def test_a_failed_scale_out_is_logged_and_the_job_goes_on(tmp_path: Path, caplog):
    """The engine refuses a scale-out's launches: scale_to (the auto-scaler's tick, inside the
    controller's loop) does not raise; the slots shrink to the nodes launched and the job no
    longer waits for the others."""
    store = SqliteStateStore(str(tmp_path / "state.db"))
    engine = FakeEngine()
    controller = _scaling(store, engine)
    controller.start()
    engine.fail_launch_of = {"el-worker-1-0", "el-worker-2-0"}
    controller.scale_to(3, "test")  # nothing launched
    assert controller.slots == 1 and "scale-out to 3 nodes failed" in caplog.text
    engine.fail_launch_of = {"el-worker-2-1"}
    controller.scale_to(3, "test")  # one of two launched
    assert [s.node_id for s in engine.launched] == ["el-worker-0-0", "el-worker-1-1"]
    assert controller.slots == 2 and controller.relaunches["scale_out"] == 1
    _lose_all(controller.job, ["el-worker-0-0", "el-worker-1-1"])
    assert (
        controller.job.lifecycle.ended.is_set()
        and controller.job.lifecycle.reason == "every node was lost"
    )
    store.close()


def test_a_scale_in_withdraws_the_relaunches_it_drops() -> None:
    """A relaunch waiting for its back-off in a slot that is scaled in is dropped, and the job
    stops expecting it: losing every other node then fails the job."""
    from dlrover.master.state_store import MemoryStateStore

    spec = job_spec_from_dict(
        {"name": "si", "entrypoint": "t.py", "nodes": "1:2", "max_relaunches": 3}
    )
    job = JobMaster(JobMasterConfig("si", RendezvousConfig(1, 2)), MemoryStateStore())
    engine = FakeEngine()
    controller = NodeController(
        job, engine, spec, "127.0.0.1:1", "t", relaunch_delay_s=60.0, clock=lambda: 0.0
    )
    controller.start()
    job.members.register_node(Registration("h", 1, "si-worker-1-0", "default", -1, 1))
    engine.fail("si-worker-1-0")
    controller.step(5.0)  # its replacement si-worker-1-1 is due in 60 s
    assert [s.node_id for s in engine.launched] == ["si-worker-0-0", "si-worker-1-0"]
    controller.scale_to(1, "test")
    _lose_all(job, ["si-worker-0-0"])
    assert job.lifecycle.ended.is_set() and job.lifecycle.reason == "every node was lost"
