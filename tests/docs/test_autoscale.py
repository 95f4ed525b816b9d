"""docs/autoscale.md's "Try it": the auto-scaled job as written, and the `dlrover status` line
the page gives for it while it runs."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.docs.blocks import Shell, doc_block, marker_id, user_dir, user_env, wait_for


@pytest.mark.slow
def test_try_it(tmp_path: Path) -> None:
    """Substituted: /tmp/ becomes the test's directory (a second run must not resume from the
    first's checkpoint). Promised: the page's `dlrover status NAME` showing the last plan while
    it runs, the two scaling lines, rank 0 printing `world 3`; then the test stops the job."""
    block = doc_block(marker_id(__file__, "test_try_it"))
    page = (REPO / "docs" / "autoscale.md").read_text()
    status = re.search(r"`(dlrover status [\w.-]+)`", page[page.index(block.text) :])
    assert status, "the page lost its `dlrover status NAME` after the block"
    where, env = user_dir(tmp_path), user_env(tmp_path)
    job = Shell(block.text.replace("/tmp/", f"{tmp_path}/"), where, env, tmp_path / "job.log")
    try:
        last = [""]

        def shows_a_plan() -> bool:
            done = subprocess.run(
                ["bash", "-c", status[1]], cwd=where, env=env, capture_output=True, text=True,
                timeout=60,
            )  # fmt: skip
            last[0] = done.stdout + done.stderr
            return done.returncode == 0 and "auto-scale: scale_out" in done.stdout

        try:
            wait_for(f"`{status[1]}` to show a plan", shows_a_plan, timeout=120, interval=1)
        except AssertionError as e:
            raise AssertionError(f"{e}; it said: {last[0]}") from None
        name = status[1].split()[-1]
        stdout = tmp_path / "dlrover-home" / "jobs" / name / "nodes" / f"{name}-worker-0-0"
        world3 = re.compile(r"^step \d+/400 world 3 ", re.MULTILINE)
        wait_for(
            "rank 0 to print `world 3`",
            lambda: (stdout / "stdout").exists() and world3.search((stdout / "stdout").read_text()),
            timeout=240,
            interval=1,
        )
        out = job.output()
        assert "scaling from 1 to 2 nodes: first step from MIN" in out, out[-4000:]
        assert re.search(r"scaling from 2 to 3 nodes: node 2 added \+\d+%", out), out[-4000:]
        # What the page promises is seen; the rest of the 400 steps would only cost CI time
        # (tests/e2e/test_autoscale.py runs scaled jobs to their end).
        stop = subprocess.run(
            ["dlrover", "stop", name], cwd=where, env=env, capture_output=True, timeout=60
        )
        assert stop.returncode == 0, stop
        job.wait(timeout=60)
    finally:
        job.close()
