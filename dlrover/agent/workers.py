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

from dlrover.agent.zygote import PopenWorker, WorkerHandle, Zygote, ZygoteError

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


def python_unbuffered(argv: Sequence[str]) -> bool:
    """Whether ``argv`` (``[python, options..., script | -m module | -c code, ...]``) passes
    ``-u``, so that a worker forked in its place buffers its output the same way."""
    args = iter(argv[1:])
    for arg in args:
        if arg.startswith("--"):  # --check-hash-based-pycs MODE: the only one that runs code
            next(args, None)
            continue
        if not arg.startswith("-") or arg == "-":
            return False  # the script: the interpreter's options end here
        for index, letter in enumerate(arg[1:]):
            if letter == "u":
                return True
            if letter in "mc":
                return False  # the module or code follows: the options end here
            if letter in "XW":  # takes a value: the rest of this argument or the next one
                if index == len(arg) - 2:
                    next(args, None)
                break
    return False


@dataclass
class WorkerLaunch:
    """The blueprint of one worker process."""

    local_rank: int
    rank: int
    argv: Sequence[str]
    """Full command line for a fresh process."""
    env: dict[str, str]
    log_dir: str | None
    """Directory for stdout.log / stderr.log / error.json; None: inherit the agent's streams."""
    redirect: int = STD_NONE
    tee: int = STD_NONE
    prefix: str = ""
    script_argv: Sequence[str] | None = None
    """`[script, args...]` or `["-m", module, args...]` when a zygote may fork this worker."""


@dataclass
class WorkerExit:
    """One worker's exit as it lands in ``WorkerGroup.exits``: its ranks, pid, Popen-style
    returncode (-9 when it could not be read) and wall-clock time."""

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

    A worker's exit lands in `exits` the moment it happens (a waiter thread for a Popen child,
    the zygote's pidfd report for a forked one), so the agent learns of a dead worker in
    milliseconds. Workers run in their own process groups (stopping one also stops what it
    forked) and die with the agent (PR_SET_PDEATHSIG).
    """

    def __init__(self) -> None:
        self.exits: queue.Queue[WorkerExit] = queue.Queue()
        self._handles: dict[int, WorkerHandle] = {}
        self._threads: list[threading.Thread] = []
        self._files: list[IO[bytes]] = []
        self.returncodes: dict[int, int] = {}
        self.forked = 0
        """How many workers of this group were forked from a zygote."""

    @property
    def pids(self) -> dict[int, int]:
        """Local rank -> pid of every worker started in this group, alive or not."""
        return {lr: h.pid for lr, h in self._handles.items()}

    def start(self, launches: Sequence[WorkerLaunch], zygote: Zygote | None = None) -> None:
        """Start every worker; must run on a long-lived thread (the death signal is per thread)."""
        preexec = _pdeathsig_preexec()
        for w in launches:
            handle = None
            if zygote is not None and w.script_argv is not None and not w.tee:
                handle = self._fork(zygote, w)
            if handle is None:
                handle = self._popen(w, preexec)
            self._handles[w.local_rank] = handle
            handle.add_exit_callback(self._on_exit(w.local_rank, w.rank))

    def _on_exit(self, local_rank: int, rank: int) -> Callable[[WorkerHandle], None]:
        def report(handle: WorkerHandle) -> None:
            code = handle.poll()
            self.exits.put(WorkerExit(local_rank, rank, handle.pid, -9 if code is None else code))

        return report

    def _fork(self, zygote: Zygote, w: WorkerLaunch) -> WorkerHandle | None:
        assert w.script_argv is not None
        # The agent's own stdout/stderr descriptors, as a Popen child inherits them: the worker
        # shares their open files, so with `dlrover-run > file` it writes at the same offset
        # as the agent instead of over it.
        out: int | str = sys.stdout.fileno() if sys.stdout is not None else 1
        err: int | str = sys.stderr.fileno() if sys.stderr is not None else 2
        if w.log_dir is not None:
            os.makedirs(w.log_dir, exist_ok=True)
            if w.redirect & STD_OUT:
                out = os.path.join(w.log_dir, "stdout.log")
            if w.redirect & STD_ERR:
                err = os.path.join(w.log_dir, "stderr.log")
        try:
            handle = zygote.spawn(
                w.script_argv,
                w.env,
                os.getcwd(),
                out,
                err,
                unbuffered=python_unbuffered(w.argv),
            )
        except ZygoteError as e:
            logger.warning(
                "zygote could not fork local rank %d (%s); starting it afresh", w.local_rank, e
            )
            return None
        self.forked += 1
        return handle

    def _popen(self, w: WorkerLaunch, preexec: Callable[[], None] | None) -> WorkerHandle:
        stdout: int | IO[bytes] | None = None
        stderr: int | IO[bytes] | None = None
        tees: list[tuple[int, IO[bytes], str]] = []
        if w.log_dir is not None:
            os.makedirs(w.log_dir, exist_ok=True)
            for bit, name, console in (
                (STD_OUT, "stdout.log", sys.stdout.buffer),
                (STD_ERR, "stderr.log", sys.stderr.buffer),
            ):
                path = os.path.join(w.log_dir, name)
                if w.tee & bit:
                    tees.append((bit, console, path))
                    target: int | IO[bytes] = subprocess.PIPE
                elif w.redirect & bit:
                    target = open(path, "ab")  # noqa: SIM115 - closed in close()
                    self._files.append(target)
                else:
                    continue
                if bit == STD_OUT:
                    stdout = target
                else:
                    stderr = target
        proc = subprocess.Popen(  # noqa: S603 - the user's own command
            list(w.argv),
            env=w.env,
            stdout=stdout,
            stderr=stderr,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=preexec,  # noqa: PLW1509 - only calls prctl through a resolved pointer
        )
        for bit, console, path in tees:
            src = proc.stdout if bit == STD_OUT else proc.stderr
            assert src is not None
            t = _Tee(src, path, console, w.prefix.encode())
            t.start()
            self._threads.append(t)
        return PopenWorker(proc)

    def alive(self) -> list[int]:
        """Local ranks of the workers still running."""
        return [lr for lr, h in self._handles.items() if h.poll() is None]

    def kill_ranks(self, local_ranks: Sequence[int], sig: int = signal.SIGKILL) -> None:
        """Send `sig` to these workers' process groups (their exits arrive in `exits`)."""
        for local_rank in local_ranks:
            handle = self._handles.get(local_rank)
            if handle is not None:
                handle.kill(sig)

    def signal_all(self, sig: int, only_leaders: bool = False) -> None:
        """Signal every live worker's process group (or just the worker processes)."""
        for h in self._handles.values():
            if h.poll() is None:
                if only_leaders:
                    try:
                        os.kill(h.pid, sig)
                    except ProcessLookupError:
                        pass
                else:
                    h.kill(sig)

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
            for h in self._handles.values():
                h.wait(max(0.0, deadline - time.monotonic()))
            if self.alive():
                logger.warning(
                    "workers %s ignored %s; sending SIGKILL", self.alive(), signal.Signals(sig).name
                )
                self.signal_all(signal.SIGKILL)
                for h in self._handles.values():
                    if h.wait(5.0) is None:
                        logger.error("worker pid %d survived SIGKILL for 5s", h.pid)
        # Whatever a worker forked lives in its process group: make sure none outlives it.
        for h in self._handles.values():
            h.kill(signal.SIGKILL)
        self.close()

    def close(self) -> None:
        """Wait for the tee threads (2 s each at most) and close the log files; ``stop`` calls
        it."""
        for t in self._threads:
            t.join(timeout=2.0)
        for f in self._files:
            f.close()
        self._files.clear()
