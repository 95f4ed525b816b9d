"""Node resources on the local engine are real limits: a node over its memory is OOM-killed by
the kernel, relaunched with more memory, and the job ends with the failure-free model; with no
relaunch left the job fails saying which sizes were tried."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from dlrover.engines.cgroups import CgroupRoot
from tests.conftest import SCRIPTS, dlrover_cli
from tests.e2e.test_fault_tolerance import final, steps_log

ROOT, WHY = CgroupRoot.detect()
pytestmark = pytest.mark.skipif(ROOT is None, reason=f"no cgroup can be made here: {WHY}")


def _job(
    tmp: Path, name: str, memory: str, hold_mib: int, max_relaunches: int = 3, **extra: str
) -> Path:
    (tmp / f"{name}-ckpt").mkdir()
    spec = {
        "name": name,
        "entrypoint": str(SCRIPTS / "oracle_train.py"),
        "args": ["--steps", "10", "--hold-mib", str(hold_mib), "--ckpt",
                 str(tmp / f"{name}-ckpt"), "--out", str(tmp / name)],
        "nodes": 1,
        "nproc_per_node": 1,
        "max_relaunches": max_relaunches,
        "resources": {"memory": memory} if memory else {},
        **extra,
    }  # fmt: skip
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(spec))
    return path


def _run(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return dlrover_cli(tmp / "home", *args, timeout=300)


@pytest.mark.e2e
def test_an_oom_killed_node_is_relaunched_with_more_memory_until_it_fits(tmp_path: Path) -> None:
    ref = _run(tmp_path, "submit", str(_job(tmp_path, "ref", "", 500)))
    assert ref.returncode == 0, ref.stderr
    r = _run(tmp_path, "submit", str(_job(tmp_path, "small", "600Mi", 500)))
    assert r.returncode == 0, r.stderr
    assert "OOM-killed with 600 MiB; its replacement gets 900 MiB" in r.stderr
    assert final(tmp_path / "small") == final(tmp_path / "ref")
    assert [s for s, _, _ in steps_log(tmp_path / "small")] == list(range(1, 11))
    diagnosis = _run(tmp_path, "diagnose", "small").stdout
    assert "oom          relaunch_node     OOM-killed at its 600 MiB memory limit" in diagnosis


@pytest.mark.e2e
def test_with_no_relaunch_left_the_job_fails_naming_the_memory_tried(tmp_path: Path) -> None:
    r = _run(tmp_path, "submit", str(_job(tmp_path, "big", "600Mi", 1500, max_relaunches=1)))
    assert r.returncode != 0
    assert "node slot 0 was OOM-killed with 600 MiB, 900 MiB" in r.stderr, r.stderr[-3000:]
    assert "give each node more memory (resources.memory)" in r.stderr


@pytest.mark.e2e
def test_at_the_memory_cap_the_job_fails_naming_the_cap_and_the_sizes(tmp_path: Path) -> None:
    job = _job(tmp_path, "cap", "600Mi", 1500, oom_max_memory="700Mi")
    r = _run(tmp_path, "submit", str(job))
    assert r.returncode != 0
    assert "OOM-killed with 600 MiB; its replacement gets 700 MiB" in r.stderr  # capped growth
    assert "cannot grow: the memory cap is 700 MiB" in r.stderr, r.stderr[-3000:]
    assert "node slot 0 was OOM-killed with 600 MiB, 700 MiB" in r.stderr
