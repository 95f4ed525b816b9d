"""Read a worker's Python stacks and CPU time from outside it (for hang warnings and restarts)."""

from __future__ import annotations

import os
import time

import psutil

from dlrover.agent.bootstrap import request_stack_dump


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of `pid` and all its descendants; None once it is gone."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return None
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def is_stopped(pid: int) -> bool:
    """Whether `pid` is stopped (SIGSTOP, or a debugger's stop): it cannot dump its stacks."""
    try:
        status = psutil.Process(pid).status()
    except psutil.Error:
        return False
    return status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


def collect_stacks(
    targets: dict[int, tuple[int, str]], timeout_s: float = 2.0, settle_s: float = 0.1
) -> dict[int, str]:
    """Ask each worker (key -> (pid, stack file)) to dump its stacks; return key -> the dump.

    A bootstrapped worker's faulthandler appends the dump to its stack file from a signal
    handler, so it arrives within milliseconds; a dump is taken as complete once its file has
    not grown for `settle_s`. Workers that do not answer within `timeout_s` get an explanation.
    """
    sizes: dict[int, int] = {}
    for key, (pid, path) in targets.items():
        sizes[key] = _size(path)
        if not request_stack_dump(pid):
            sizes.pop(key)
    dumps = {key: "(the process had already exited)" for key in targets if key not in sizes}
    deadline = time.monotonic() + timeout_s
    last_growth = {key: time.monotonic() for key in sizes}
    seen = dict(sizes)
    while sizes:
        now = time.monotonic()
        for key in list(sizes):
            path = targets[key][1]
            size = _size(path)
            if size != seen[key]:
                seen[key], last_growth[key] = size, now
            elif size > sizes[key] and now - last_growth[key] >= settle_s:
                dumps[key] = _read_from(path, sizes.pop(key))
            elif now >= deadline:
                sizes.pop(key)
                dumps[key] = (
                    f"(no stack dump within {timeout_s:.0f}s: the process may be stuck in native "
                    f"code that holds the GIL; try py-spy dump --native --pid {targets[key][0]})"
                )
        if sizes:
            time.sleep(0.02)  # polling a file another process appends to; bounded by `deadline`
    return dumps


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_from(path: str, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace").rstrip()
