"""docs/embedding.md's blocks: a job with embedding servers scaled while it trains, and
servers started by hand, grown to three with `EmbeddingCluster`."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.docs.blocks import Shell, doc_block, marker_id, user_dir, user_env, wait_for

RESIZED = re.compile(
    r"^job wd: 3 embedding servers in [\d.]+s: \d+ buckets, \d+ rows moved; "
    r"moving buckets paused [\d.]+s, training went on$",
    re.MULTILINE,
)


def bash(line: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-euo", "pipefail", "-c", line], cwd=cwd, env=env, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.e2e
def test_a_job_with_embedding_servers(tmp_path: Path) -> None:
    """The submit line without its `&` runs in the background here (the test keeps its exit
    status); `dlrover scale` is typed once the worker trains, then `dlrover status`. Promised:
    scale prints what moved, status lists three servers (their stats are read every 5 s: the
    test asks until the third is listed), and the job ends 0 at step 300."""
    block = doc_block(marker_id(__file__, "test_a_job_with_embedding_servers"))
    submit, scale, status = [line for line in block.text.splitlines() if line.strip()]
    assert submit.rstrip().endswith("&") and "--name wd" in submit
    where, env = user_dir(tmp_path), user_env(tmp_path)
    job = Shell(submit.rstrip().removesuffix("&"), where, env, tmp_path / "submit.log")
    try:

        def training() -> bool:
            done = bash(status, where, env)
            return done.returncode == 0 and re.search(r"^wd-worker-0-0 +0 running ", done.stdout,
                                                      re.MULTILINE) is not None  # fmt: skip

        wait_for("the worker of job wd to train", training, timeout=120, interval=0.1)
        scaled = bash(scale, where, env)
        assert scaled.returncode == 0, scaled.stdout + scaled.stderr
        assert RESIZED.search(scaled.stdout), scaled.stdout

        def three_servers() -> bool:
            done = bash(status, where, env)
            return re.search(r"^ps 2 +127\.0\.0\.1:\d+ ", done.stdout, re.MULTILINE) is not None

        wait_for("`dlrover status wd` to list the third server", three_servers, timeout=30)
        assert job.wait(timeout=180) == 0, job.output()[-4000:]
        rank0 = bash("dlrover logs wd --rank 0", where, env)  # the worker's own lines
        assert "step 300/300 loss" in rank0.stdout, rank0.stdout[-4000:] + rank0.stderr
    finally:
        job.close()


@pytest.mark.e2e
def test_servers_started_by_hand(tmp_path: Path) -> None:
    """The bash block as written, /tmp/ substituted by the test's directory; then, as the page
    says, a third server started the same way and the Python block run with `ps0`..`ps2` read
    from the three env files and `token` from $DLROVER_JOB_TOKEN; then the servers stopped.
    Promised: the training prints the rows held on the servers, the resize moves buckets and
    rows onto the new server."""
    shell_block = doc_block(marker_id(__file__, "test_servers_started_by_hand"), 0)
    python_block = doc_block(marker_id(__file__, "test_servers_started_by_hand"), 1)
    assert shell_block.language == "bash" and python_block.language == "python"
    tmp = f"{tmp_path}/"
    third = (
        f"dlrover-ps --write-env {tmp}ps2.env &\nwhile [ ! -e {tmp}ps2.env ]; do sleep 0.1; done\n"
    )
    grow = (
        "python - <<'PY'\n"
        "import os\n"
        f"ps0, ps1, ps2 = (open(f'{tmp}ps{{i}}.env').read().strip().split('=', 1)[1]"
        " for i in range(3))\n"
        "token = os.environ['DLROVER_JOB_TOKEN']\n"
        f"{python_block.text}"
        "PY\n"
    )
    text = shell_block.text.replace("/tmp/", tmp) + third + grow + "kill $(jobs -p)\nwait\n"
    shell = Shell(text, user_dir(tmp_path), user_env(tmp_path), tmp_path / "shell.log")
    try:
        code = shell.wait(timeout=180)
        out = shell.output()
        assert code == 0, out[-4000:]
        rows = re.search(r"^(\d+) rows on the servers$", out, re.MULTILINE)
        moved = re.search(r"^(\d+) (\d+) [\d.e-]+$", out, re.MULTILINE)
        assert rows and moved, out[-4000:]
        assert 0 < int(moved[1]) <= 1024 and 0 < int(moved[2]) < int(rows[1]), out[-4000:]
        assert out.count("embedding server on 127.0.0.1:") == 3, out[-4000:]  # all 3 stopped
    finally:
        shell.close()
