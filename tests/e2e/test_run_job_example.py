"""examples/run_job.py, the documented way to run a job from Python (docs/architecture.md), runs
a two-node job to its end and leaves the record `dlrover status` reads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, clean_env


@pytest.mark.e2e
def test_the_job_runner_example_runs_a_two_node_job_to_success(tmp_path: Path):
    home = tmp_path / "home"
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "run_job.py")],
        env=clean_env(DLROVER_HOME=str(home)),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "job from-python succeeded (exit code 0): all 2 nodes succeeded" in done.stdout
    record = (home / "jobs" / "from-python" / "job.json").read_text()
    assert '"state": "succeeded"' in record
    # Each node's agent ran the script; rank 0's loss lines are in its per-rank log.
    nodes = home / "jobs" / "from-python" / "nodes"
    assert len(sorted(nodes.glob("*/stderr"))) == 2
    assert "loss" in "".join(p.read_text() for p in nodes.glob("*/ranks/*/attempt_*/rank_0/*.log"))
