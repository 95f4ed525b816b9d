"""Workers' output under dlrover-run: every line of every attempt, forked or spawned, lands
exactly once where dlrover-run's output goes, and a line printed right before a crash is there."""

from __future__ import annotations

import collections
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, SCRIPTS, clean_env, run_cmd

LINES = 30
LINE = re.compile(r"^(line|err|last) attempt=(\d) rank=(\d)(?: i=(\d+))?$")


def _expected(attempt: int, stream: str) -> collections.Counter[str]:
    want: collections.Counter[str] = collections.Counter()
    for rank in range(2):
        if stream == "stdout":
            want.update(f"line attempt={attempt} rank={rank} i={i}" for i in range(LINES))
            if attempt < 2 and rank == 1 - attempt % 2:
                want[f"last attempt={attempt} rank={rank}"] += 1
        else:
            want[f"err attempt={attempt} rank={rank}"] += 1
    return want


def _worker_lines(text: str) -> collections.Counter[str]:
    return collections.Counter(line for line in text.splitlines() if LINE.match(line))


def _run(tmp_path: Path, *flags: str) -> tuple[int, str]:
    """dlrover-run with stdout and stderr on one file opened as `> file 2>&1` does (O_TRUNC,
    no O_APPEND): the agent, spawned and forked workers all write through it."""
    console = tmp_path / "console.txt"
    (tmp_path / "sync").mkdir()
    env = clean_env(LINES=str(LINES), SYNC_DIR=str(tmp_path / "sync"), CONSOLE_FILE=str(console))
    env["DLROVER_ZYGOTE_NICE"] = "0"  # ready while the machine is busy (tests run in parallel)
    env.pop("PYTHONUNBUFFERED", None)  # the unbuffered output must come from dlrover-run's -u
    with open(console, "w") as out:
        code = subprocess.run(
            [
                *run_cmd("dlrover.cli.run"),
                "--standalone",
                "--nproc_per_node=2",
                "--max-restarts=2",
                "--monitor-interval=0.1",
                *flags,
                str(SCRIPTS / "numbered_lines.py"),
            ],
            env=env,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=240,
        ).returncode
    text = console.read_text(errors="replace")
    # The first start and both restarts forked.
    assert text.count("forked 2 workers from the zygote") == 3, text
    return code, text


@pytest.mark.e2e
def test_every_line_of_every_attempt_lands_once_in_the_redirected_output(
    tmp_path: Path,
) -> None:
    code, text = _run(tmp_path)
    assert code == 0, text
    want: collections.Counter[str] = collections.Counter()
    for attempt in range(3):
        want += _expected(attempt, "stdout") + _expected(attempt, "stderr")
    assert _worker_lines(text) == want, text
    # The agent's own lines were not overwritten either (it wrote through the same file).
    assert "started 2 workers (ranks 0..1, restart 2)" in text


@pytest.mark.e2e
def test_redirected_workers_write_every_line_to_their_attempt_logs(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    code, text = _run(tmp_path, "--log-dir", str(logs), "--redirects", "3", "--rdzv-id", "job")
    assert code == 0, text
    assert not _worker_lines(text), text  # all of it went to the files
    for attempt in range(3):
        for stream in ("stdout", "stderr"):
            seen = sum(
                (
                    _worker_lines(
                        (
                            logs / "job" / f"attempt_{attempt}" / f"rank_{r}" / f"{stream}.log"
                        ).read_text()
                    )
                    for r in range(2)
                ),
                collections.Counter(),
            )
            assert seen == _expected(attempt, stream), (attempt, stream)
