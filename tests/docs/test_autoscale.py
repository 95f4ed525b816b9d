"""docs/autoscale.md's "Try it": the auto-scaled job as written, and the `dlrover status` line
the page gives for it while it runs."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.docs.blocks import Shell, doc_block, marker_id, user_dir, user_env, wait_for


@pytest.mark.long
@pytest.mark.e2e
def test_try_it(tmp_path: Path) -> None:
    """Substituted: /tmp/ becomes the test's directory (a second run must not resume from the
    first's checkpoint). Promised: the page's `dlrover status NAME` showing the last plan while
    it runs, after `scaling from 1 to 2 nodes: first step from MIN`; then the test stops it."""
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
        first = "scaling from 1 to 2 nodes: first step from MIN"
        wait_for(f"the log line {first!r}", lambda: first in job.output(), timeout=30)
        # The page's command and status line are what this test adds: the job going on to 3
        # nodes (another 50 s here) is tests/e2e/test_autoscale.py's
        # test_a_job_whose_throughput_scales_goes_from_min_to_max_nodes, the same script.
        name = status[1].split()[-1]
        stop = subprocess.run(
            ["dlrover", "stop", name], cwd=where, env=env, capture_output=True, timeout=60
        )
        assert stop.returncode == 0, stop
        job.wait(timeout=60)
    finally:
        job.close()
