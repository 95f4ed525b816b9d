"""`dlrover submit --auto-scale` without resources: the master measures the nodes' use, sizes
them, relaunches them at that size, and the job goes on to the failure-free result."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from dlrover.engines.cgroups import CgroupRoot
from tests.conftest import SCRIPTS, dlrover_cli
from tests.e2e.test_fault_tolerance import final, steps_log


def _submit(tmp: Path, name: str, *flags: str, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp / f"{name}-ckpt").mkdir()
    args = [
        "submit", "--name", name, "--nnodes", "2", "--nproc-per-node", "1", *flags,
        str(SCRIPTS / "oracle_train.py"), "--steps", "60", "--step-time", "0.1",
        "--ckpt", str(tmp / f"{name}-ckpt"), "--out", str(tmp / name),
    ]  # fmt: skip
    return dlrover_cli(tmp / "home", *args, timeout=300, **env)


def test_a_job_without_resources_is_sized_from_its_measured_use(tmp_path: Path) -> None:
    ref = _submit(tmp_path, "ref")
    assert ref.returncode == 0, ref.stderr
    r = _submit(
        tmp_path, "auto", "--auto-scale",
        DLROVER_AUTOSCALE_INTERVAL_S="1", DLROVER_AUTOSCALE_SIZING_S="3",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    plan = re.search(
        r"auto-scale: resize: measured peak (\d+) MiB and ([\d.]+) cores per node: "
        r"(\d+) MiB, ([\d.]+) CPU \(x1.3\)",
        r.stderr,
    )
    assert plan, r.stderr[-4000:]
    peak, cores, memory, cpu = int(plan[1]), float(plan[2]), int(plan[3]), float(plan[4])
    assert 100 < peak < 4000 and memory == -(-peak * 13 // 10)  # peak x 1.3, rounded up
    assert cpu >= max(0.5, cores * 1.3) - 1e-9
    assert f"resizing 2 node(s) to {memory} MiB, {cpu:g} CPU" in r.stderr
    nodes = sorted(p.name for p in (tmp_path / "home" / "jobs" / "auto" / "nodes").iterdir())
    assert nodes == ["auto-worker-0-0", "auto-worker-0-1", "auto-worker-1-0", "auto-worker-1-1"]
    if CgroupRoot.detect()[0] is not None:
        assert "node resources are enforced" in r.stderr  # the resized nodes run limited
    assert final(tmp_path / "auto") == final(tmp_path / "ref")
    assert [s for s, _, _ in steps_log(tmp_path / "auto")] == list(range(1, 61))
