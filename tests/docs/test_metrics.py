"""docs/metrics.md's console block: a submitted job's dashboard address, as submit prints it and
as `dlrover status` shows it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.docs.blocks import Shell, doc_block, marker_id, user_dir, user_env, wait_for


@pytest.mark.e2e
def test_the_dashboard_address(tmp_path: Path) -> None:
    """The `$ ` lines are the commands (the submit in the background, as a second terminal
    types the status while it runs); the other lines are what they print, the numbers and the
    address this machine's. Promised: both show the same dashboard URL, status's first line is
    the job's state with its round and goodput. Then the test stops the job (its 2000 steps
    would only cost CI time)."""
    block = doc_block(marker_id(__file__, "test_the_dashboard_address"))
    commands = [line[2:] for line in block.text.splitlines() if line.startswith("$ ")]
    submit, status = commands
    name = status.split()[-1]
    where, env = user_dir(tmp_path), user_env(tmp_path)
    job = Shell(submit, where, env, tmp_path / "submit.log")
    try:
        shown = [""]

        def status_shows_the_dashboard() -> bool:
            done = subprocess.run(
                ["bash", "-c", status], cwd=where, env=env, capture_output=True, text=True,
                timeout=60,
            )  # fmt: skip
            shown[0] = done.stdout
            return done.returncode == 0 and "running" in done.stdout

        wait_for(f"`{status}` to show the running job", status_shows_the_dashboard, 120)

        state = rf"^job {re.escape(name)}: running \(round \d+, goodput [\d.]+%\)"
        assert re.search(state, shown[0], re.MULTILINE), shown[0]
        dashboard = re.search(r"^dashboard: (http://[\d.]+:\d+/)$", shown[0], re.MULTILINE)
        assert dashboard, shown[0]
        printed = f"job {name}: metrics and dashboard on {dashboard[1]}"
        assert printed in job.output(), job.output()[-4000:]
        stop = subprocess.run(
            ["dlrover", "stop", name], cwd=where, env=env, capture_output=True, timeout=60
        )
        assert stop.returncode == 0, stop
        job.wait(timeout=60)
    finally:
        job.close()
