"""Asking the kernel about other processes (foundation: imports nothing of DLRover)."""

from __future__ import annotations

import os

import psutil


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (it may belong to another user: then it does)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class UsageMeter:
    """CPU percent and resident memory of a set of processes, sampled at each heartbeat.

    psutil measures a process's CPU percent between two calls on the same `Process` object, so
    the objects are kept from one sample to the next (a fresh one always says 0.0)."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}

    def sample(self, pids: list[int]) -> tuple[float, int]:
        """(cpu percent since the last sample, resident bytes) summed over ``pids``, ignoring
        those already gone; a process seen for the first time counts 0% CPU this once."""
        cpu, mem = 0.0, 0
        seen: dict[int, psutil.Process] = {}
        for pid in pids:
            try:
                p = self._procs.get(pid) or psutil.Process(pid)
                cpu += p.cpu_percent(None)
                mem += p.memory_info().rss
                seen[pid] = p
            except psutil.Error:
                pass
        self._procs = seen
        return cpu, mem
