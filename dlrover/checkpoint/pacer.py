"""A CPU cap for persist threads that binds only while the node has no CPU to spare."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

SPARE_IDLE_SHARE = 0.25
"""The node has CPU to spare while at least this share of its CPU time is idle (or waiting
for I/O): then a persist runs unpaced."""
PROBE_EVERY_S = 0.05
"""How often the node's idle share is read again (/proc/stat) while a persist runs."""


class NodeIdleProbe:
    """The share of the node's CPU time that was idle or waiting for I/O since the last call,
    from /proc/stat; 0.0 (no CPU to spare) where /proc/stat cannot be read."""

    def __init__(self, path: str = "/proc/stat") -> None:
        self.path = path
        self._last = self._read()

    def _read(self) -> tuple[int, int] | None:
        try:
            with open(self.path) as f:
                fields = f.readline().split()
        except OSError:
            return None
        if not fields or fields[0] != "cpu":
            return None
        ticks = [int(x) for x in fields[1:]]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
        return idle, sum(ticks[:8])  # user..steal; guest time is already in user

    def __call__(self) -> float:
        """The idle share since the previous call (or since this probe was made)."""
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None or now[1] <= last[1]:
            return 0.0
        return (now[0] - last[0]) / (now[1] - last[1])


class CpuPacer:
    """Keeps the CPU time of a group of threads under ``cpus`` CPUs' worth of wall time (None:
    no cap) while the node is saturated, by making a thread that is ahead of the cap sleep;
    while the node has CPU to spare (``idle_share()`` >= SPARE_IDLE_SHARE) nothing is paced and
    no debt builds up.

    A persist is paced rather than only deprioritised: its CPU time is the same at any
    priority, and on a saturated node a cap spreads it so that the trainers lose at most
    ``cpus`` while it runs; on a node with idle CPUs it takes them and ends as fast as the disk
    allows (docs/checkpoint.md, "A busy node")."""

    def __init__(
        self,
        cpus: float | None,
        idle_share: Callable[[], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cpus = cpus
        self._idle_share = idle_share if idle_share is not None else NodeIdleProbe()
        self._clock = clock
        self._start = clock()
        self._probed = self._start
        self._spare = False
        self._used = 0.0
        self._lock = threading.Lock()

    def charge(self, since: float) -> float:
        """Add the calling thread's CPU time since ``since`` (a ``time.thread_time()``), sleep
        while the group is ahead of its cap; returns the thread's CPU time now."""
        used = time.thread_time() - since
        ahead = self.account(used)
        if ahead > 0:
            time.sleep(ahead)  # pacing, not waiting for an event: the cap is a rate
        return time.thread_time()

    def account(self, used: float) -> float:
        """Add ``used`` CPU-seconds; the seconds the group is ahead of its cap (<= 0: none)."""
        if self.cpus is None:
            return 0.0
        with self._lock:
            now = self._clock()
            if now - self._probed >= PROBE_EVERY_S:
                self._spare = self._idle_share() >= SPARE_IDLE_SHARE
                self._probed = now
            if self._spare:  # CPU to spare: unpaced, and the cap's window starts again
                self._start, self._used = now, 0.0
                return 0.0
            self._used += used
            return self._used / self.cpus - (now - self._start)
