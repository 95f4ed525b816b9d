"""Worker processes of one node: start them with their logs, notice exits at once, stop them."""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO

logger = logging.getLogger(__name__)

STD_NONE, STD_OUT, STD_ERR, STD_ALL = 0, 1, 2, 3


def _pdeathsig_preexec() -> Callable[[], None] | None:
    """A pre-exec hook that kills the worker when the agent dies, even by SIGKILL (Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
    prctl = libc.prctl
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the agent died before prctl took effect
            os._exit(137)

    return preexec


@dataclass
class WorkerLaunch:
    """The blueprint of one worker process."""

    local_rank: int
    rank: int
    argv: Sequence[str]
    env: dict[str, str]
    log_dir: str | None
    """Directory for stdout.log / stderr.log / error.json; None: inherit the agent's streams."""
    redirect: int = STD_NONE
    tee: int = STD_NONE
    prefix: str = ""


@dataclass
class WorkerExit:
    local_rank: int
    rank: int
    pid: int
    returncode: int
    """Negative: killed by that signal."""
    at: float = field(default_factory=time.time)


class _Tee(threading.Thread):
    """Copies a worker's pipe to its log file and, prefixed per line, to the agent's stream."""

    def __init__(self, src: IO[bytes], file_path: str, console: IO[bytes] | None, prefix: bytes):
        super().__init__(daemon=True, name="dlrover-tee")
        self._src, self._path, self._console, self._prefix = src, file_path, console, prefix

    def run(self) -> None:
        with open(self._path, "ab", buffering=0) as f:
            for line in iter(self._src.readline, b""):
                f.write(line)
                if self._console is not None:
                    try:
                        self._console.write(self._prefix + line)
                        self._console.flush()
                    except (OSError, ValueError):
                        pass
        self._src.close()


class WorkerGroup:
    """The worker processes of one attempt on this node.

    Each worker has a waiter thread blocked in wait(); its exit lands in a queue at once, so the
    agent learns of a dead worker in milliseconds. Workers run in their own process groups (so
    stopping one also stops what it forked) and die with the agent (PR_SET_PDEATHSIG).
    """

    def __init__(self) -> None:
        self.exits: queue.Queue[WorkerExit] = queue.Queue()
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._ranks: dict[int, int] = {}
        self._threads: list[threading.Thread] = []
        self._files: list[IO[bytes]] = []
        self.returncodes: dict[int, int] = {}

    @property
    def pids(self) -> dict[int, int]:
        return {lr: p.pid for lr, p in self._procs.items()}

    def start(self, launches: Sequence[WorkerLaunch]) -> None:
        """Start every worker; must run on a long-lived thread (the death signal is per thread)."""
        preexec = _pdeathsig_preexec()
        for w in launches:
            stdout: int | IO[bytes] | None = None
            stderr: int | IO[bytes] | None = None
            tees: list[tuple[str, IO[bytes] | None, str]] = []
            if w.log_dir is not None:
                os.makedirs(w.log_dir, exist_ok=True)
                for bit, name, console in (
                    (STD_OUT, "stdout.log", sys.stdout.buffer),
                    (STD_ERR, "stderr.log", sys.stderr.buffer),
                ):
                    path = os.path.join(w.log_dir, name)
                    if w.tee & bit:
                        tees.append((name, console, path))
                    elif w.redirect & bit:
                        f = open(path, "ab")  # noqa: SIM115 - closed in close()
                        self._files.append(f)
                        if bit == STD_OUT:
                            stdout = f
                        else:
                            stderr = f
                for name, _console, _path in tees:
                    if name == "stdout.log":
                        stdout = subprocess.PIPE
                    else:
                        stderr = subprocess.PIPE
            proc = subprocess.Popen(  # noqa: S603 - the user's own command
                list(w.argv),
                env=w.env,
                stdout=stdout,
                stderr=stderr,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=preexec,  # noqa: PLW1509 - only calls prctl through a resolved pointer
            )
            self._procs[w.local_rank] = proc
            self._ranks[w.local_rank] = w.rank
            for name, console, path in tees:
                src = proc.stdout if name == "stdout.log" else proc.stderr
                assert src is not None
                t = _Tee(src, path, console, w.prefix.encode())
                t.start()
                self._threads.append(t)
            waiter = threading.Thread(
                target=self._wait, args=(w.local_rank, proc), daemon=True, name="dlrover-waiter"
            )
            waiter.start()
            self._threads.append(waiter)

    def _wait(self, local_rank: int, proc: subprocess.Popen[bytes]) -> None:
        rc = proc.wait()
        self.exits.put(WorkerExit(local_rank, self._ranks[local_rank], proc.pid, rc))

    def alive(self) -> list[int]:
        return [lr for lr, p in self._procs.items() if p.poll() is None]

    def signal_all(self, sig: int, only_leaders: bool = False) -> None:
        """Signal every live worker's process group (or just the worker processes)."""
        for p in self._procs.values():
            if p.poll() is None:
                try:
                    if only_leaders:
                        os.kill(p.pid, sig)
                    else:
                        os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def stop(self, grace_s: float, sig: int = signal.SIGTERM) -> None:
        """Send `sig` to every worker's process group; SIGKILL what is left after `grace_s`."""
        if self.alive():
            logger.info(
                "stopping workers %s with %s (grace %.1fs)",
                self.alive(),
                signal.Signals(sig).name,
                grace_s,
            )
            self.signal_all(sig)
            deadline = time.monotonic() + grace_s
            for p in self._procs.values():
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            if self.alive():
                logger.warning(
                    "workers %s ignored %s; sending SIGKILL", self.alive(), signal.Signals(sig).name
                )
                self.signal_all(signal.SIGKILL)
                for p in self._procs.values():
                    try:
                        p.wait(timeout=5.0)
                    except subprocess.TimeoutExpired:
                        logger.error("worker pid %d survived SIGKILL for 5s", p.pid)
        # Whatever a worker forked lives in its process group: make sure none outlives it.
        for p in self._procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.close()

    def close(self) -> None:
        for t in self._threads:
            t.join(timeout=2.0)
        for f in self._files:
            f.close()
        self._files.clear()
