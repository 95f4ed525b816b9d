"""Flash checkpoint on a node whose trainers keep every core busy: no save is skipped."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.conftest import SCRIPTS, clean_env, dlrover_run

SEED = 27  # the kill step is drawn from it: a failure names the step it used


def _run(tmp: Path, name: str, faults: str = "") -> Path:
    out = tmp / name
    (tmp / f"{name}-ckpt").mkdir()
    r = dlrover_run(
        [
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=2",
            "--rdzv-id",
            f"busy-{name}",
            str(SCRIPTS / "flash_train.py"),
            "--steps",
            "24",
            "--disk-every",
            "10",
            "--busy",
            "--no-wait",
            "--ckpt",
            str(tmp / f"{name}-ckpt"),
            "--out",
            str(out),
        ],
        env=clean_env(DLROVER_FAULTS=faults),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-6000:]
    assert "skipping the memory save" not in r.stderr
    return out


@pytest.mark.e2e
def test_a_worker_killed_on_a_busy_node_resumes_from_its_newest_memory_save(tmp_path: Path):
    """Two ranks, each with a spinning side thread (2 cores saturated), save to memory every
    step and to disk every 10th without waiting for persists; every save returns True (the
    script asserts it). SIGKILL of a worker at a random step k+1 (seeded, k not a disk step):
    the restart loads step k from memory and the final model equals the failure-free run's."""
    k = random.Random(SEED).choice([s for s in range(11, 20) if s % 10])
    ref = _run(tmp_path, "ref")
    killed = _run(tmp_path, "killed", faults=f"kill:rank={k % 2}:step={k + 1}")
    assert (Path(f"{killed}.final")).read_text() == Path(f"{ref}.final").read_text(), f"k={k}"
    lines = Path(f"{killed}.steps").read_text().split("\n")
    resumes = [line for line in lines if line.startswith("resume")]
    assert resumes == ["resume 1 None", f"resume {k + 1} memory"], f"k={k}"
    steps = [int(x) for x in lines if x and not x.startswith("resume")]
    assert steps == list(range(1, 25)), f"k={k}"
