"""The master's embedding-server controller against an engine whose nodes are real in-process
embedding servers: slots reused after a scale-in, a server that exits (not failed) replaced, a
replacement that dies before it registers, a stale failure ignored, a failed resize rolled back."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from dlrover.constants import PS_ADDRESS_KEY, PS_SCALE_KEY
from dlrover.embedding.client import EmbeddingClient
from dlrover.embedding.server import EmbeddingServer
from dlrover.engines.base import FailureReason, Node, NodeSpec
from dlrover.jobspec import job_spec_from_dict
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.ps_controller import PsController
from dlrover.master.rendezvous import RendezvousConfig
from dlrover.master.state_store import MemoryStateStore
from dlrover.proto import embedding_pb2 as pb
from dlrover.testing.fake_engine import FakeEngine

TOKEN = "tok"


class ServerEngine(FakeEngine):
    """Each launched ps node is an in-process EmbeddingServer that registers its address the
    way `dlrover-ps` does; ``stillborn`` node ids die before registering."""

    def __init__(self, job: JobMaster) -> None:
        super().__init__()
        self.job = job
        self.servers: dict[str, EmbeddingServer] = {}
        self.stillborn: set[str] = set()

    def launch(self, spec: NodeSpec) -> Node:
        node = super().launch(spec)
        if spec.node_id in self.stillborn:
            self.fail(spec.node_id, FailureReason.EXIT_CODE, message="died at start")
        elif spec.node_id not in self.servers:
            server = self.servers[spec.node_id] = EmbeddingServer(TOKEN).start()
            self.job.kv.set(PS_ADDRESS_KEY + spec.node_id, server.address.encode())
            self.run(spec.node_id)
        return node

    def delete(self, node_id: str) -> None:
        self.stop_server(node_id)
        super().delete(node_id)

    def stop_server(self, node_id: str) -> None:
        server = self.servers.get(node_id)
        if server is not None:
            server.stop(0)


@pytest.fixture
def setup() -> Iterator[tuple[JobMaster, ServerEngine, PsController, Callable[[], None]]]:
    spec = job_spec_from_dict(
        {"name": "j", "entrypoint": "t.py", "roles": {"ps": {"count": 2, "replica": "sync"}}}
    )
    job = JobMaster(JobMasterConfig("j", RendezvousConfig(1, 1)), MemoryStateStore())
    engine = ServerEngine(job)
    controller = PsController(job, engine, spec, "127.0.0.1:1", TOKEN, stats_interval_s=0.2)
    job.roles.register("ps", controller)

    def pump() -> None:  # what the node controller does with the engine's events
        for event in engine.events(0.0):
            if event.spec.role == "ps":
                controller.on_event(event)

    controller.start()
    assert controller.ready.wait(30)
    try:
        yield job, engine, controller, pump
    finally:
        controller.close()
        for server in engine.servers.values():
            server.stop(0)


def _report(job: JobMaster, request: int, timeout_s: float = 30) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        raw = job.kv.get(PS_SCALE_KEY)
        report = json.loads(raw) if raw else {}
        if report.get("request") == request:
            return dict(report)
        time.sleep(0.02)  # the controller's thread writes it
    raise AssertionError(f"no report of request {request}: {job.lifecycle.reason}")


def _scale(job: JobMaster, count: int) -> dict[str, object]:
    _, request = job.roles.scale_role("ps", count)
    return _report(job, request)


def _until(check: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _rows(controller: PsController, ids: np.ndarray) -> np.ndarray:
    client = EmbeddingClient(list(controller.addresses), TOKEN)
    client.adopt(controller._cluster.client.placement)  # type: ignore[union-attr]
    return client.lookup("t", ids, 4)


def _train(controller: PsController) -> tuple[np.ndarray, np.ndarray]:
    client = EmbeddingClient(list(controller.addresses), TOKEN)
    client.create_table(pb.TableSpec(name="t", dim=4, optimizer="sgd", lr=0.1))
    ids = np.arange(3000, dtype=np.int64)
    client.push("t", ids, np.ones((ids.size, 4), dtype=np.float32))
    return ids, client.lookup("t", ids, 4)


def test_a_slot_scaled_in_and_out_again_gets_a_new_server(setup) -> None:  # type: ignore[no-untyped-def]
    job, engine, controller, _ = setup
    ids, rows = _train(controller)
    for count in (3, 2, 3):
        report = _scale(job, count)
        assert "error" not in report and report["servers"] == count, report
    assert [s.node_id for s in engine.launched] == ["j-ps-0-0", "j-ps-1-0", "j-ps-2-0", "j-ps-2-1"]
    assert np.array_equal(_rows(controller, ids), rows)


def test_a_server_that_exits_unasked_is_replaced_and_a_stale_failure_is_ignored(setup) -> None:  # type: ignore[no-untyped-def]
    job, engine, controller, pump = setup
    ids, rows = _train(controller)
    engine.stop_server("j-ps-1-0")
    engine.succeed("j-ps-1-0")  # exit 0 after a SIGTERM nobody in the job sent
    pump()
    _until(lambda: controller.failovers == 1, f"not replaced: {job.lifecycle.reason}")
    assert np.array_equal(_rows(controller, ids), rows)
    engine.fail("j-ps-1-0")  # a late, duplicate event of the server already replaced
    pump()
    assert _scale(job, 3)["servers"] == 3  # the controller is alive and did nothing else
    assert controller.failovers == 1 and not job.lifecycle.ended.is_set()


def test_a_replacement_that_dies_before_it_registers_is_tried_again(setup) -> None:  # type: ignore[no-untyped-def]
    job, engine, controller, pump = setup
    ids, rows = _train(controller)
    engine.stillborn.add("j-ps-0-1")
    engine.stop_server("j-ps-0-0")
    engine.fail("j-ps-0-0", FailureReason.SIGNAL)
    pump()
    _until(lambda: controller.failovers == 1, f"not replaced: {job.lifecycle.reason}")
    assert [s.node_id for s in engine.launched][-2:] == ["j-ps-0-1", "j-ps-0-2"]
    assert np.array_equal(_rows(controller, ids), rows)
    assert [f.node_id for f in job.diagnostics.failures()] == ["j-ps-0-0"]


@pytest.mark.parametrize("when", ["before the freeze", "after the freeze"])
def test_a_resize_that_fails_midway_leaves_the_old_servers_serving(setup, when: str) -> None:  # type: ignore[no-untyped-def]
    """The added server is gone before the rows move (its table cannot be created), or once
    the leaving buckets are frozen (the rows cannot land): the old servers serve every row,
    nothing stays frozen, the added node is deleted and the job goes on."""
    job, engine, controller, _ = setup
    ids, rows = _train(controller)
    cluster = controller._cluster
    set_map = cluster._set_map

    def set_map_then_lose_the_new_server(address, placement, index, frozen=()):  # type: ignore[no-untyped-def]
        set_map(address, placement, index, frozen)
        if len(frozen) or when == "before the freeze":
            engine.stop_server("j-ps-2-0")

    if when == "before the freeze":
        launch = engine.launch

        def launch_then_die(spec: NodeSpec) -> Node:
            node = launch(spec)
            engine.stop_server(spec.node_id)  # registered, then gone
            return node

        engine.launch = launch_then_die  # type: ignore[method-assign]
    else:
        cluster._set_map = set_map_then_lose_the_new_server  # type: ignore[method-assign]
    report = _scale(job, 3)
    assert "j-ps-2-0" in engine.deleted and "error" in report, report
    if when == "after the freeze":
        assert "rolled back to map version" in str(report["error"]), report
    assert not job.lifecycle.ended.is_set() and len(controller.addresses) == 2
    assert np.array_equal(_rows(controller, ids), rows)  # nothing frozen, nothing lost
    cluster._set_map = set_map  # type: ignore[method-assign]
    engine.launch = ServerEngine.launch.__get__(engine)  # type: ignore[method-assign]
    assert _scale(job, 3)["servers"] == 3  # and it can be tried again (a new attempt)
    assert np.array_equal(_rows(controller, ids), rows)


def test_a_restarted_master_launches_each_server_with_the_memory_it_grew_to() -> None:
    spec = job_spec_from_dict(
        {
            "name": "j",
            "entrypoint": "t.py",
            "roles": {"ps": {"count": 2, "replica": "sync", "resources": {"memory": "1Gi"}}},
        }
    )
    store = MemoryStateStore()
    job = JobMaster(JobMasterConfig("j", RendezvousConfig(1, 1)), store)
    engine = ServerEngine(job)
    controller = PsController(job, engine, spec, "127.0.0.1:1", TOKEN, store=store)
    again: PsController | None = None
    controller.start()
    try:
        assert controller.ready.wait(30)
        engine.stop_server("j-ps-0-0")
        engine.fail("j-ps-0-0", FailureReason.OOM_KILLED)
        for event in engine.events(0.0):
            controller.on_event(event)
        _until(lambda: controller.failovers == 1, f"not replaced: {job.lifecycle.reason}")
        grown = engine.launched[-1]
        assert grown.node_id == "j-ps-0-1" and grown.resources.memory_mib > 1024
        controller.close()

        # The master restarts on its state; its servers still run (the engine adopts them).
        job2 = JobMaster(JobMasterConfig("j", RendezvousConfig(1, 1)), store)
        engine2 = ServerEngine(job2)
        again = PsController(job2, engine2, spec, "127.0.0.1:1", TOKEN, store=store)
        again.start()
        assert again.ready.wait(30)
        launched = {s.node_id: s.resources.memory_mib for s in engine2.launched}
        assert launched == {"j-ps-0-1": grown.resources.memory_mib, "j-ps-1-0": 1024}
    finally:
        controller.close()
        if again is not None:
            again.close()
        for server in [*engine.servers.values()]:
            server.stop(0)
        if again is not None:
            for server in engine2.servers.values():
                server.stop(0)
