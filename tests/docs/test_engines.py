"""docs/engines.md's status-and-logs block: a submitted job run to its end, then its ended
status (the node with its pids) and rank 0's own log lines."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.docs.blocks import doc_block, marker_id, user_dir, user_env


@pytest.mark.e2e
def test_a_job_s_status_and_rank_log(tmp_path: Path) -> None:
    """Each line as written, in order (comments are what the docs promise it prints)."""
    block = doc_block(marker_id(__file__, "test_a_job_s_status_and_rank_log"))
    submit, status, logs = [line.split("#")[0].strip() for line in block.text.splitlines()]
    where, env = user_dir(tmp_path), user_env(tmp_path)

    def run(command: str) -> str:
        done = subprocess.run(
            ["bash", "-c", command], cwd=where, env=env, capture_output=True, text=True,
            timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, (command, done.stdout[-3000:], done.stderr[-3000:])
        return done.stdout + done.stderr

    run(submit)
    shown = run(status)
    assert re.search(r"^job hello: succeeded", shown, re.MULTILINE), shown
    assert "plans: none" in shown and "failures: none" in shown, shown
    assert re.search(r"\bpid\b", shown, re.IGNORECASE), shown  # the node's pids are listed
    printed = run(logs)
    losses = re.findall(r"step (\d+)/40 loss [\d.]+", printed)
    assert losses[0] == "10" and losses[-1] == "40", printed
