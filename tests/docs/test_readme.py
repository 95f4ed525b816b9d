"""README.md's "Several nodes" and `dlrover submit | status | stop` blocks, run as written in a
fresh directory (the repository's examples/ linked in, a fresh $DLROVER_HOME). README's "Two
commands" are not run here: .ci/run runs them verbatim in a fresh virtual environment."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.docs.blocks import Shell, doc_block, marker_id, user_dir, user_env, wait_for


def command_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def bash(line: str, cwd: Path, env: dict[str, str], timeout: float = 60) -> tuple[int, str]:
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", line],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return done.returncode, done.stdout + done.stderr


@pytest.mark.e2e
def test_several_nodes(tmp_path: Path) -> None:
    """Three terminals, as a user on one machine would open them: the master (line 1) in one,
    and in each "node" the `set -a` line then its `dlrover-run`. Nothing substituted (the block
    asks for port 0 already). Promised: the master prints the two variables, the nodes form one
    job of world size 4, and every process ends 0 when the job ends."""
    block = doc_block(marker_id(__file__, "test_several_nodes"))
    master_line, source_line, node0, node1 = command_lines(block.text)
    assert master_line.startswith("dlrover-master ") and "--write-env master.env" in master_line
    where, env = user_dir(tmp_path), user_env(tmp_path)
    master = Shell(master_line, where, env, tmp_path / "master.log")
    nodes: list[Shell] = []
    try:
        wait_for(
            "master.env with both variables",
            lambda: "DLROVER_JOB_TOKEN=" in _read(where / "master.env"),
            timeout=60,
        )
        for i, line in enumerate((node0, node1)):
            nodes.append(Shell(f"{source_line}\n{line}", where, env, tmp_path / f"node{i}.log"))
        for i, node in enumerate(nodes):
            assert node.wait(timeout=180) == 0, f"node {i}:\n{node.output()[-4000:]}"
        assert master.wait(timeout=60) == 0, master.output()[-4000:]
        out = master.output()
        assert re.search(r"^DLROVER_MASTER_ADDR=\S+:\d+$", out, re.MULTILINE), out[-4000:]
        assert re.search(r"^DLROVER_JOB_TOKEN=\S+$", out, re.MULTILINE), out[-4000:]
        assert "round 1 closed with 2 nodes (world size 4)" in out, out[-4000:]
        assert "running -> succeeded (all 2 nodes succeeded)" in out, out[-4000:]
        assert any("step 200/200 loss" in node.output() for node in nodes)
    finally:
        for shell in (*nodes, master):
            shell.close()


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


@pytest.mark.e2e
def test_submit_status_diagnose_stop(tmp_path: Path) -> None:
    """The submit line without its trailing `&` runs in the background here (the test keeps its
    exit status), then each next line as written, as a user types them while it trains. Promised
    by the comments: status lists the nodes with rank, state, step, restarts, cpu, memory and
    pids; logs prints rank 0's own lines; diagnose lists the failures (none); stop stops the
    workers, the nodes are removed, submit exits non-zero."""
    block = doc_block(marker_id(__file__, "test_submit_status_diagnose_stop"))
    submit, status, logs, diagnose, stop = command_lines(block.text)
    assert submit.rstrip().endswith("&") and "--name mlp" in submit
    where, env = user_dir(tmp_path), user_env(tmp_path)
    job = Shell(submit.rstrip().removesuffix("&"), where, env, tmp_path / "submit.log")
    try:

        def running_table() -> str:
            code, out = bash(status, where, env)
            rows = [line for line in out.splitlines() if line.startswith("mlp-worker-")]
            running = len(rows) >= 2 and all(" running " in row for row in rows)
            return out if code == 0 and running else ""

        table = str(wait_for("`dlrover status mlp` to list running nodes", running_table, 90))
        header = r"^node +rank +state +step +restarts +cpu% +mem MB +pid +worker pids"
        assert re.search(header, table, re.M), table
        nodes = re.findall(r"^(mlp-worker-\d+-\d+) ", table, re.MULTILINE)

        def rank0_trained() -> str:
            code, out = bash(logs, where, env)
            return out if code == 0 and re.search(r"^step \d+/2000 loss", out, re.M) else ""

        wait_for("`dlrover logs mlp --rank 0` to show a loss line", rank0_trained, 90)

        code, out = bash(diagnose, where, env)
        assert code == 0 and out.strip() == "job mlp: no failures recorded", out

        code, out = bash(stop, where, env)
        assert code == 0 and "job mlp stopped" in out, out
        assert job.wait(timeout=90) != 0
        submitted = job.output()
        assert "job mlp failed: stopped by dlrover stop" in submitted, submitted[-4000:]
        for node in nodes:  # (a third may still be starting)
            # Deleted by the master, or ended by its agent that heard of the stop first.
            removed = (
                rf"^.* node {node}: running -> (deleted|failed \(exit_code: exited with code 1\))$"
            )
            assert re.search(removed, submitted, re.MULTILINE), (node, submitted[-4000:])
    finally:
        job.close()
