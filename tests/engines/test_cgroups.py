"""Node cgroups of the local engine on this machine's real cgroup filesystem (skipped where no
cgroup can be made), and the say-once fallback where none can."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from dlrover.engines import cgroups
from dlrover.engines.base import NodeSpec, NodeState, Resources, wait_for_event
from dlrover.engines.cgroups import CgroupRoot, join_cgroup
from dlrover.engines.local import LocalEngine

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
