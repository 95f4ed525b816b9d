"""What a stalled job's processes were doing, for the message of a test that waited in vain.

A job that stops before its first step on a loaded machine (seen a few times in CI, never here)
leaves nothing in its logs: every process is alive and waiting. The report names each process
under the test (pid, parent, state, CPU seconds, threads, command) and, where py-spy is installed
(the test extra installs it), each Python process's native and Python stacks.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import psutil

MAX_DUMPS = 16
DUMP_TIMEOUT_S = 20.0


def process_report(extra_roots: Iterable[int] = ()) -> str:
    """Every process under this test process (and under `extra_roots`), with its stacks."""
    seen: dict[int, psutil.Process] = {}
    for root_pid in (None, *extra_roots):
        try:
            root = psutil.Process(root_pid)
            tree = root.children(recursive=True) + ([root] if root_pid is not None else [])
        except psutil.Error:
            continue
        for process in tree:
            seen.setdefault(process.pid, process)
    lines = ["processes under the test (pid ppid state cpu-s threads command):"]
    python: list[psutil.Process] = []
    for pid, process in sorted(seen.items()):
        try:
            with process.oneshot():
                times = process.cpu_times()
                command = " ".join(process.cmdline())[:160]
                lines.append(
                    f"  {pid} {process.ppid()} {process.status()} "
                    f"{times.user + times.system:.1f} {process.num_threads()} {command}"
                )
                if "python" in process.name() or command.startswith(("python", "/")):
                    python.append(process)
        except psutil.Error:
            lines.append(f"  {pid} (gone)")
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        lines.append("(py-spy is not installed: no stacks; pip install py-spy)")
        return "\n".join(lines)
    busiest = sorted(python, key=_cpu_s, reverse=True)[:MAX_DUMPS]
    with ThreadPoolExecutor(max_workers=4) as pool:
        dumps = list(pool.map(lambda p: _dump(py_spy, p.pid), busiest))
    for process, dump in zip(busiest, dumps, strict=True):
        lines.append(f"== py-spy dump --native --pid {process.pid}\n{dump}")
    return "\n".join(lines)


def _cpu_s(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()
    except psutil.Error:
        return -1.0
    return times.user + times.system


def _dump(py_spy: str, pid: int) -> str:
    try:
        done = subprocess.run(
            [py_spy, "dump", "--native", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=DUMP_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"(py-spy did not answer within {DUMP_TIMEOUT_S:.0f}s)"
    return (done.stdout + done.stderr).strip()[-6000:]


def until(
    condition: Callable[[], bool],
    what: str,
    procs: Sequence[subprocess.Popen[bytes] | subprocess.Popen[str]],
    timeout: float,
    every_s: float = 0.2,
    said: Callable[[], str] = lambda: "",
) -> None:
    """Poll ``condition`` (on files other processes write: nothing to wait on but them) until it
    holds. Fails the test naming ``what`` when one of ``procs`` ends first, or with ``said()``
    and every process's stacks when ``timeout`` passes."""
    import pytest

    deadline = time.monotonic() + timeout
    while not condition():
        ended = [p.args for p in procs if p.poll() is not None]
        assert not ended, f"{ended} ended while waiting for {what}"
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} within {timeout:g}s\n{said()}\n{process_report()}")
        time.sleep(every_s)


def end_all(
    procs: Sequence[subprocess.Popen[bytes] | subprocess.Popen[str]], grace_s: float = 30
) -> None:
    """SIGTERM every process still running (an agent stops its workers and zygote on the way
    out), then SIGKILL whichever has not exited within ``grace_s``."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
