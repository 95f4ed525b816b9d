"""docs/health_check.md's first block: a job submitted with the node check, and its status."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.docs.blocks import Shell, doc_block, marker_id, user_dir, user_env, wait_for

VERDICT = re.compile(r" node check of round 1: 3 nodes, \d+ check round\(s\), [\d.]+s; \w")
CHECK = re.compile(r"  (ok [\d.]+s|straggler [\d.]+x|faulty)$")


@pytest.mark.e2e
def test_submit_with_the_node_check(tmp_path: Path) -> None:
    """`train.py` stands for the reader's script: here a copy of examples/train_mlp.py (so the
    job is named `train`, as the page's status line says). The submit line runs in the
    background (a second terminal types the status line while it runs). Promised: status shows
    a `check` column with a verdict for every node, the master logs the check's verdict, and the
    job ends 0 (on a loaded machine the check may name a straggler: it is then replaced, and the
    job still ends 0)."""
    block = doc_block(marker_id(__file__, "test_submit_with_the_node_check"))
    submit, status = [line for line in block.text.splitlines() if line.strip()]
    where, env = user_dir(tmp_path), user_env(tmp_path)
    shutil.copy(REPO / "examples" / "train_mlp.py", where / "train.py")
    job = Shell(submit, where, env, tmp_path / "submit.log")
    try:
        seen = [""]

        def checked() -> bool:
            done = subprocess.run(
                ["bash", "-c", status], cwd=where, env=env, capture_output=True, text=True,
                timeout=60,
            )  # fmt: skip
            rows = [line for line in done.stdout.splitlines() if line.startswith("train-worker-")]
            if done.returncode == 0 and rows and all(CHECK.search(row) for row in rows):
                seen[0] = done.stdout
                return True
            return False

        wait_for("`dlrover status train` to show every node's check", checked, timeout=120)
        assert re.search(r"^node +rank .*  check$", seen[0], re.MULTILINE), seen[0]
        assert job.wait(timeout=240) == 0, job.output()[-4000:]
        assert VERDICT.search(job.output()), job.output()[-4000:]
    finally:
        job.close()
