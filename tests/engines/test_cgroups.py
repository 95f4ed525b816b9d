"""Node cgroups of the local engine on this machine's real cgroup filesystem (skipped where no
cgroup can be made): limits, resizing a running node in place, and the say-once fallback where
none can be made."""

from __future__ import annotations

import dataclasses
import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dlrover.engines import cgroups
from dlrover.engines.base import (
    Capacity,
    NodeEvent,
    NodeNotFoundError,
    NodeSpec,
    NodeState,
    ResizeUnsupportedError,
    Resources,
    wait_for_event,
)
from dlrover.engines.cgroups import CgroupRoot, join_cgroup
from dlrover.engines.local import LocalEngine
from dlrover.testing.fake_engine import FakeEngine

ROOT, WHY = CgroupRoot.detect()
needs_cgroups = pytest.mark.skipif(ROOT is None, reason=f"no cgroup can be made here: {WHY}")


@needs_cgroups
def test_a_node_cgroup_limits_memory_and_cpu_and_holds_the_process() -> None:
    assert ROOT is not None
    node = ROOT.create("cg-test-0-0", Resources(cpu=0.5, memory_mib=100))
    try:
        mem = node.memory_dir
        assert mem is not None
        limit = (
            (mem / "memory.max")
            if (mem / "memory.max").exists()
            else (mem / "memory.limit_in_bytes")
        )
        assert int(limit.read_text()) == 100 << 20
        proc = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(30)"],
            preexec_fn=lambda: join_cgroup(node.procs_files()),
        )
        try:
            own = Path(f"/proc/{proc.pid}/cgroup").read_text()
            assert f"{cgroups.PREFIX}cg-test-0-0" in own
        finally:
            proc.kill()
            proc.wait()
        assert node.oom_kills() == 0
    finally:
        node.remove()
    assert not any(d.exists() for d in node.dirs)


def test_without_cgroups_nodes_run_unlimited_and_it_is_said_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(CgroupRoot, "detect", classmethod(lambda cls: (None, "no permission")))
    caplog.set_level(logging.WARNING, logger="dlrover.engines.local")
    with LocalEngine(tmp_path / "logs", stop_grace_s=1.0) as engine:
        for rank in range(2):
            spec = NodeSpec(
                job_name="j", rank=rank, command=(sys.executable, "-c", "pass"),
                resources=Resources(memory_mib=64),
            )  # fmt: skip
            engine.launch(spec)
        seen: list = []
        while sum(e.state is NodeState.SUCCEEDED for e in seen) < 2:
            wait_for_event(engine, lambda e: e.state is NodeState.SUCCEEDED, 15, seen)
    warnings = [r.message for r in caplog.records if "not enforced" in r.message]
    assert warnings == ["node resources are not enforced (nodes run unlimited): no permission"]


# A node that holds ``MiB`` more memory once the test says so, and exits when told to.
_HOLDER = """
import socket, sys
conn = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=60)
conn.recv(1)
held = bytearray(b"\\x01") * (int(sys.argv[2]) << 20)
conn.sendall(b"a")
conn.recv(1)
"""


def _holder(server: socket.socket, name: str, mib: int, resources: Resources) -> NodeSpec:
    port = server.getsockname()[1]
    command = (sys.executable, "-c", _HOLDER, str(port), str(mib))
    return NodeSpec(job_name=name, rank=0, command=command, resources=resources)


def _cpu_quota(node: cgroups.NodeCgroup) -> str:
    assert node.cpu_dir is not None
    name = "cpu.max" if node.v2 else "cpu.cfs_quota_us"
    return (node.cpu_dir / name).read_text().split()[0]


@needs_cgroups
def test_a_running_node_is_resized_in_place_and_then_holds_more_than_its_first_limit(
    tmp_path: Path,
) -> None:
    assert ROOT is not None
    with (
        socket.create_server(("127.0.0.1", 0)) as server,
        LocalEngine(tmp_path / "logs", stop_grace_s=1.0) as engine,
    ):
        server.settimeout(30)
        spec = _holder(server, "grow", 150, Resources(memory_mib=100))
        engine.launch(spec)
        conn, _ = server.accept()
        conn.settimeout(30)
        pid = engine.pid(spec.node_id)
        node = ROOT.existing(spec.node_id)
        assert node is not None and node.memory_limit_bytes() == 100 << 20
        resized = engine.resize(spec.node_id, Resources(cpu=0.5, memory_mib=300))
        assert resized.spec.resources == Resources(cpu=0.5, memory_mib=300)
        assert resized.node_id == spec.node_id
        assert node.memory_limit_bytes() == 300 << 20
        if node.cpu_dir is not None:
            assert _cpu_quota(node) == "50000"
        conn.sendall(b"g")
        assert conn.recv(1) == b"a"  # 150 MiB held: over the first limit, under the new one
        used = node.memory_use_bytes()
        assert used > 150 << 20
        # Lowering is refused below what the node uses, and leaves the limit as it was.
        with pytest.raises(ResizeUnsupportedError, match=r"uses \d+ MiB now: a 120 MiB limit"):
            engine.resize(spec.node_id, Resources(memory_mib=120))
        assert node.memory_limit_bytes() == 300 << 20
        engine.resize(spec.node_id, Resources(memory_mib=(used >> 20) + 50))  # above use: fine
        assert node.memory_limit_bytes() == ((used >> 20) + 50) << 20
        conn.sendall(b"s")
        conn.close()
        seen: list[NodeEvent] = []
        end = wait_for_event(engine, lambda e: e.state.is_final, 30, seen)
        assert end.state is NodeState.SUCCEEDED, seen  # no OOM kill, the same process all along
        assert node.oom_kills() == 0 and engine.pid(spec.node_id) == pid
        assert end.spec.resources.memory_mib == (used >> 20) + 50
        with pytest.raises(ResizeUnsupportedError, match="ended"):
            engine.resize(spec.node_id, Resources(memory_mib=500))


@needs_cgroups
def test_a_node_launched_without_resources_is_limited_in_place(tmp_path: Path) -> None:
    assert ROOT is not None
    with (
        socket.create_server(("127.0.0.1", 0)) as server,
        LocalEngine(tmp_path / "logs", stop_grace_s=1.0) as engine,
    ):
        server.settimeout(30)
        spec = dataclasses.replace(_holder(server, "unsized", 10, Resources()), resizable=True)
        engine.launch(spec)
        conn, _ = server.accept()
        node = ROOT.existing(spec.node_id)
        assert node is not None and node.memory_limit_bytes() is None  # unlimited, its own
        engine.resize(spec.node_id, Resources(cpu=1.0, memory_mib=400))
        assert node.memory_limit_bytes() == 400 << 20
        if node.cpu_dir is not None:
            assert _cpu_quota(node) == "100000"
        assert engine.capacity() == Capacity()  # none configured: unknown
        conn.close()
        end = wait_for_event(engine, lambda e: e.state.is_final, 30)
        assert end.state is NodeState.SUCCEEDED


def test_an_engine_that_cannot_resize_says_so_and_changes_nothing(tmp_path: Path) -> None:
    fake = FakeEngine()
    spec = NodeSpec(job_name="j", rank=0, command=("true",), resources=Resources(memory_mib=64))
    fake.launch(spec)
    with pytest.raises(ResizeUnsupportedError, match="the FakeEngine cannot resize a running node"):
        fake.resize(spec.node_id, Resources(memory_mib=128))
    with LocalEngine(tmp_path / "logs", stop_grace_s=1.0, enforce_resources=False) as engine:
        node = engine.launch(NodeSpec(job_name="j", rank=0, command=("sleep", "30")))
        with pytest.raises(ResizeUnsupportedError, match="without a cgroup of its own"):
            engine.resize(node.node_id, Resources(memory_mib=128))
    # Unsized and not resizable: no cgroup (its processes share the CPU as any other's).
    with LocalEngine(tmp_path / "logs2", stop_grace_s=1.0) as engine:
        node = engine.launch(NodeSpec(job_name="j", rank=0, command=("sleep", "30")))
        assert ROOT is None or ROOT.existing(node.node_id) is None
        with pytest.raises(ResizeUnsupportedError, match="not resizable"):
            engine.resize(node.node_id, Resources(memory_mib=128))
        assert engine.list_nodes()[0].spec.resources == Resources()
        with pytest.raises(NodeNotFoundError):
            engine.resize("j-worker-9-0", Resources(memory_mib=128))
