"""The Python blocks of docs/architecture.md and docs/engines.md, run as a user's script in a
fresh directory (the repository's examples/ linked in, a fresh $DLROVER_HOME)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.docs.blocks import doc_block, marker_id, user_dir, user_env


def run_python(text: str, tmp: Path, timeout: float) -> str:
    where = user_dir(tmp)
    (where / "snippet.py").write_text(text)
    done = subprocess.run(
        [sys.executable, "snippet.py"],
        cwd=where,
        env=user_env(tmp),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.e2e
def test_job_runner_from_python(tmp_path: Path) -> None:
    """docs/architecture.md, "Running a job from Python": two nodes of examples/train_mlp.py on
    the local engine, as written; the printed outcome is the one the comment shows."""
    block = doc_block(marker_id(__file__, "test_job_runner_from_python"))
    out = run_python(block.text, tmp_path, timeout=180)
    assert out.startswith(
        "JobOutcome(state='succeeded', reason='all 2 nodes succeeded', exit_code=0"
    ), out


def test_an_engine_added_by_name(tmp_path: Path) -> None:
    """docs/engines.md, "Engines by name": the block as written, then the call its last comment
    names (`runner.start()`), and the FakeEngine its factory made has the job's node launched
    (read from the controller only to find that FakeEngine)."""
    block = doc_block(marker_id(__file__, "test_an_engine_added_by_name"))
    check = (
        "assert runner.start()\n"
        "try:\n"
        "    runner.step(0.1)\n"
        "    engine = runner._controller.engine\n"
        "    assert isinstance(engine, FakeEngine), engine\n"
        "    print('launched', [s.node_id for s in engine.launched])\n"
        "finally:\n"
        "    runner.stop('the doc test is done')\n"
        "    runner.close()\n"
    )
    out = run_python(block.text + check, tmp_path, timeout=60)
    assert out.strip() == "launched ['train-worker-0-0']", out
