"""docs/fault_tolerance.md's in-process recovery script, run as the page says, once as is and
once with rank 1 SIGKILLed at step 10 from outside: rank 0 keeps its process, the killed rank
is replaced, and the final checksum is the failure-free run's."""

from __future__ import annotations

import os
import queue
import re
import shlex
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.docs.blocks import doc_block, marker_id, user_dir, user_env

TEST = "test_the_page_s_script_survives_a_kill_in_its_process"
STARTS = re.compile(r"rank (\d+) \(pid (\d+)\) starts at step (\d+)")


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str | None]:
    """The job's output lines as they come (None: the output ended)."""
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def _starts(lines: list[str]) -> list[re.Match[str]]:
    """Every "rank R (pid P) starts at step S" (two ranks printing at once can share a line:
    print writes the text and its newline separately)."""
    return [m for line in lines for m in STARTS.finditer(line)]


def _run(where: Path, env: dict[str, str], kill_at: str | None) -> list[str]:
    """The page's command in ``where``; with ``kill_at``, rank 1 is SIGKILLed when that line
    appears. Every output line."""
    command = shlex.split(doc_block(marker_id(__file__, TEST), 1).text.strip())
    proc = subprocess.Popen(
        command, cwd=where, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    seen: list[str] = []
    lines = _lines(proc)
    deadline = time.monotonic() + 180
    armed = False  # the kill line appeared: kill rank 1 as soon as its pid is known
    try:
        while True:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            if line is None:
                break
            seen.append(line)
            armed = armed or (kill_at is not None and line.endswith(kill_at))
            if armed:
                starts = [m for m in _starts(seen) if m[1] == "1"]
                if starts:
                    os.kill(int(starts[-1][2]), signal.SIGKILL)
                    armed, kill_at = False, None
        assert proc.wait(timeout=60) == 0, "\n".join(seen[-80:])
        assert kill_at is None, "rank 1 was never killed:\n" + "\n".join(seen[-80:])
    finally:
        if proc.poll() is None:
            proc.kill()
    return seen


@pytest.mark.e2e
def test_the_page_s_script_survives_a_kill_in_its_process(tmp_path: Path) -> None:
    script = doc_block(marker_id(__file__, TEST)).text
    assert '"/tmp/inprocess-ckpt"' in script, "the page's script no longer names its folder"
    where, env = user_dir(tmp_path), user_env(tmp_path)
    (where / "train.py").write_text(
        script.replace('"/tmp/inprocess-ckpt"', repr(str(tmp_path / "c")))
    )

    plain = _run(where, env, None)
    killed = _run(where, env, "step 10")

    def checksum(out: list[str]) -> str:
        return next(line.split("checksum ", 1)[1] for line in out if "checksum " in line)

    assert checksum(killed) == checksum(plain)
    starts = [m.groups() for m in _starts(killed)]
    rank0 = {pid for rank, pid, _ in starts if rank == "0"}
    rank1 = {pid for rank, pid, _ in starts if rank == "1"}
    assert len(rank0) == 1, starts  # never restarted
    assert len([s for s in starts if s[0] == "0"]) >= 2, starts  # but entered again
    assert len(rank1) == 2, starts  # the killed one and its replacement
