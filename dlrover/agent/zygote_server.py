"""The zygote process: imports torch once, then forks workers on request (JSON lines, no pickle).

Run by `dlrover.agent.zygote.Zygote`, never by hand:
``python -m dlrover.agent.zygote_server --fd N --parent-pid P --preload torch,torch.optim``.

Protocol on the inherited unix socket: the typed messages of ``zygote_messages.py``, one JSON
object per line. The zygote writes `ReadyEvent` once its preload is done, then answers each
`SpawnRequest` (whose line arrives with the worker's stdout and stderr as SCM_RIGHTS
descriptors) with `SpawnedEvent` or `SpawnFailedEvent`, reports every worker's exit as
`ExitedEvent`, a line it cannot read as `ErrorEvent`, warms inductor's compiler on
`WarmRequest` (answered by `WarmedEvent`; `dlrover.agent.compiler_warmup`), and exits on
`ExitRequest`.

Fork safety: the zygote runs no torch op and never touches CUDA, so torch's intra-op pool and
the CUDA driver are not started; the only native thread after ``import torch`` is OpenBLAS's
(pulled in by numpy), which OpenBLAS itself stops in its pthread_atfork handler and restarts
lazily. The zygote refuses to fork while a second Python thread exists, and it forks only once
the thread that ran the preload has ended natively, not just in Python's eyes: a Python thread's
``join()`` returns before its native thread runs the libraries' thread-exit hooks, and MKL's
hook takes MKL's allocator lock. A fork inside that window hands the worker a lock that nobody
will release, and the worker's first matrix product spins on it for ever (a fork straight
after such a join hung in 5 of 20 tries here; none of 200 once the fork waited; the test
``test_a_fork_after_the_preload_never_inherits_mkls_lock`` repeats it).
"""

from __future__ import annotations

import argparse
import collections
import gc
import importlib
import io
import os
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

from dlrover import constants as c
from dlrover.agent.bootstrap import BootstrapError, die_with_parent, enable_stack_dumps, run_target
from dlrover.agent.collectives import start_dump_thread
from dlrover.agent.compiler_warmup import WarmupResult, warm_compiler, watch_compiler_use
from dlrover.agent.zygote_messages import (
    FDS_MARKER,
    OUTPUT_FDS,
    ErrorEvent,
    ExitedEvent,
    ExitRequest,
    ReadyEvent,
    SpawnedEvent,
    SpawnFailedEvent,
    SpawnRequest,
    WarmedEvent,
    WarmRequest,
    ZygoteEvent,
    decode_request,
    encode_event,
)
from dlrover.envvars import number_from_env
from dlrover.json_messages import MessageError
from dlrover.trainer.progress import watch_optimizer_steps

_MAX_FDS = 16
"""Room for descriptors per receive (a spawn sends OUTPUT_FDS; more is a sender's bug)."""


def _native_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


def _send(sock: socket.socket, event: ZygoteEvent) -> None:
    sock.sendall(encode_event(event))


def _check_spawn(request: SpawnRequest, fds: list[int]) -> None:
    """What the message's types do not say; ValueError names the first problem."""
    if not request.argv:
        raise ValueError("argv must be a non-empty list of strings")
    if not request.cwd:
        raise ValueError("cwd must be a non-empty path string")
    if not os.path.isdir(request.cwd):
        raise ValueError(f"cwd {request.cwd!r} is not a directory")
    if len(fds) != OUTPUT_FDS:
        raise ValueError(
            f"a spawn request comes with {OUTPUT_FDS} descriptors (stdout, stderr) in the same"
            f" sendmsg; got {len(fds)}"
        )


class _Server:
    """The zygote's event loop: requests on the socket, child exits on pidfds."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._selector = selectors.DefaultSelector()
        self._children: dict[int, int] = {}  # pidfd -> pid
        self._buffer = b""
        # Descriptor groups received and not yet paired with their (marked) line. The kernel
        # returns at most one group per read, in the order sent, but may glue a later message
        # to earlier bytes of the same read, so pairing goes by the in-band marker, not by
        # where a read starts.
        self._fd_groups: collections.deque[list[int]] = collections.deque()

    def serve(self) -> tuple[SpawnRequest, list[int]] | None:
        """Run until told to exit (returns None) or, in a forked child, return its spec and
        its output descriptors."""
        self._selector.register(self._sock, selectors.EVENT_READ)
        while True:
            for key, _ in self._selector.select():
                if key.fileobj is self._sock:
                    lines = self._receive()
                    if lines is None:  # the agent is gone: take the workers with us
                        self._kill_children()
                        return None
                    for index, (line, fds) in enumerate(lines):
                        outcome = self._handle(line, fds)
                        if isinstance(outcome, ExitRequest):
                            self._kill_children()
                            return None
                        if outcome is not None:
                            for _, later in lines[index + 1 :]:  # siblings' output: not ours
                                _close_all(later)
                            return outcome
                else:
                    self._reap(key.fd)

    def _receive(self) -> list[tuple[bytes, list[int]]] | None:
        """One read from the socket: the complete lines now buffered, each with the descriptors
        that came with it; None when the agent closed the channel."""
        data, fds, flags, _ = socket.recv_fds(
            self._sock, 1 << 16, _MAX_FDS, socket.MSG_CMSG_CLOEXEC
        )
        if not data:
            _close_all(fds)
            return None
        if fds:
            self._fd_groups.append(fds)
        if flags & socket.MSG_CTRUNC:
            _send(self._sock, ErrorEvent("descriptors were cut off (too many in one message)"))
        self._buffer += data
        lines = []
        while b"\n" in self._buffer:
            line, self._buffer = self._buffer.split(b"\n", 1)
            if line.startswith(FDS_MARKER):
                # Each marked line was one sendmsg with one group: they pair up in order.
                line = line[len(FDS_MARKER) :]
                lines.append((line, self._fd_groups.popleft() if self._fd_groups else []))
            else:
                lines.append((line, []))
        return lines

    def _handle(
        self, line: bytes, fds: list[int] | None = None
    ) -> ExitRequest | tuple[SpawnRequest, list[int]] | None:
        """ExitRequest: stop serving; (spawn, fds): we are the forked child; else None.
        Takes ownership of `fds` (closed here, or handed to the child)."""
        fds = fds or []
        try:
            request = decode_request(line)
        except MessageError as exc:
            _close_all(fds)
            _send(self._sock, ErrorEvent(str(exc)))
            return None
        if isinstance(request, WarmRequest):
            _close_all(fds)
            # On this thread, between requests: a spawn sent meanwhile waits for it, and a
            # worker's exit is reported once it is done (seconds, once per zygote).
            _send(self._sock, warm_at_priority())
            return None
        if not isinstance(request, SpawnRequest):
            _close_all(fds)
            return request if isinstance(request, ExitRequest) else None
        try:
            _check_spawn(request, fds)
            if threading.active_count() > 1:
                raise RuntimeError("zygote has a second Python thread; forking is unsafe")
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_initialized():
                raise RuntimeError("CUDA is initialised in the zygote; forking is unsafe")
        except (ValueError, RuntimeError) as exc:
            _close_all(fds)
            _send(self._sock, SpawnFailedEvent(request.request_id, str(exc)))
            return None
        zygote_pid = os.getpid()
        pid = os.fork()
        if pid == 0:
            self._become_child(zygote_pid)
            return request, fds
        _close_all(fds)
        self._children[self._watch(pid)] = pid
        _send(self._sock, SpawnedEvent(request.request_id, pid))
        return None

    def _watch(self, pid: int) -> int:
        pidfd = os.pidfd_open(pid)
        self._selector.register(pidfd, selectors.EVENT_READ)
        return pidfd

    def _reap(self, pidfd: int) -> None:
        pid = self._children.pop(pidfd)
        self._selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        returncode = os.waitstatus_to_exitcode(status)
        _send(self._sock, ExitedEvent(pid, returncode))

    def _kill_children(self) -> None:
        for pid in self._children.values():
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _become_child(self, zygote_pid: int) -> None:
        # New session: the agent kills the worker and everything it starts with killpg(pid).
        os.setsid()
        die_with_parent(zygote_pid)
        self._selector.close()
        for pidfd in self._children:
            os.close(pidfd)
        for fds in self._fd_groups:  # siblings' output, queued behind this request
            _close_all(fds)
        self._sock.close()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _redirect(spec: SpawnRequest, fds: list[int]) -> None:
    """Make the agent's descriptors the worker's fd 1 and 2, and set up sys.std* as a fresh
    ``python`` (``-u`` when asked) would on them."""
    for target, fd in zip((1, 2), fds, strict=True):
        os.dup2(fd, target)  # the copy is inheritable (no CLOEXEC), as std streams are
    _close_all(fds)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    sys.stdout = _std_stream(1, spec.unbuffered or bool(spec.env.get("PYTHONUNBUFFERED")))
    sys.stderr = _std_stream(2, spec.unbuffered or bool(spec.env.get("PYTHONUNBUFFERED")))
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))


def _std_stream(fd: int, unbuffered: bool) -> io.TextIOWrapper:
    """What the interpreter builds for fd 1 or 2 at start-up: unbuffered (``-u`` or
    PYTHONUNBUFFERED) is a raw file written through at every call; otherwise stdout is
    line-buffered on a terminal and block-buffered elsewhere, stderr always line-buffered."""
    raw = io.FileIO(fd, "w", closefd=False)
    buffer: io.RawIOBase | io.BufferedWriter = raw if unbuffered else io.BufferedWriter(raw)
    return io.TextIOWrapper(
        buffer,  # type: ignore[arg-type]
        encoding=sys.stdout.encoding if fd == 1 else sys.stderr.encoding,
        errors=sys.stdout.errors if fd == 1 else "backslashreplace",
        line_buffering=not unbuffered and (fd == 2 or raw.isatty()),
        write_through=unbuffered,
    )


def _apply_environment(spec: SpawnRequest) -> None:
    os.chdir(spec.cwd)
    os.environ.clear()
    os.environ.update(spec.env)
    # The interpreter read PYTHONPATH when the zygote started; put the worker's entries first.
    extra = [entry for entry in spec.env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    sys.path[1:1] = [entry for entry in extra if entry not in sys.path]
    torch = sys.modules.get("torch")
    if torch is not None:
        # libgomp read OMP_NUM_THREADS once, in the zygote; apply the worker's value now.
        threads = spec.env.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        # numpy seeded its global generator once in the zygote; siblings must not share it.
        numpy_random.seed()


def run_child(spec: SpawnRequest, fds: list[int]) -> None:
    """In the forked worker: become the process `python script.py` would have been, run it."""
    _redirect(spec, fds)
    _apply_environment(spec)
    enable_stack_dumps()
    start_dump_thread()
    watch_optimizer_steps()
    watch_compiler_use()
    try:
        run_target(spec.argv)
    except BootstrapError as exc:
        print(f"dlrover zygote worker: {exc}", file=sys.stderr)
        sys.exit(2)


def preload_at_priority(modules: list[str]) -> None:
    """Import `modules` in a helper thread running at the nice value DLROVER_ZYGOTE_NICE
    (default 0: the first workers fork from the zygote, so its imports are on their path).

    At 19 the imports take only the CPU the workers leave idle. On Linux a nice value belongs to
    one thread, so the main thread, which forks the workers, keeps the normal priority and the
    workers inherit that. Elsewhere it would apply to the whole process, so the imports run at
    normal priority there. The agent bounds the whole preload (it kills a zygote not ready in
    time), so the join below needs no deadline of its own.

    With autogroup scheduling (the Linux default on desktops and many servers) nice values only
    rank threads inside one session's group, and every worker has a session of its own: the
    zygote therefore also takes a session of its own and sets that group's nice to the same
    value. A forked worker starts a new session, whose group has the normal weight again.
    """
    nice = _zygote_nice()
    if sys.platform.startswith("linux"):
        own_session_at_lowest_weight(nice)

    def work() -> None:
        for module in modules:
            importlib.import_module(module)

    run_at_priority(work, nice)


def _zygote_nice() -> int:
    nice = int(number_from_env(c.ENV_ZYGOTE_NICE, c.DEFAULT_ZYGOTE_NICE, "a nice value, 0-19"))
    if nice > 19:
        raise ValueError(f"{c.ENV_ZYGOTE_NICE}={nice}: give a nice value, 0-19")
    return nice


def run_at_priority(work: Callable[[], None], nice: int) -> None:
    """Run `work` in a helper thread at `nice` and return once that thread has ended natively
    (see `_wait_native_exit`), re-raising what it raised. The main thread keeps its priority."""
    failure: list[BaseException] = []
    native_id: list[int] = []

    def run() -> None:
        native_id.append(threading.get_native_id())
        try:
            if sys.platform.startswith("linux"):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
            work()
        except BaseException as exc:  # re-raised in the main thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="zygote-preload")
    thread.start()
    thread.join()
    _wait_native_exit(native_id[0], PRELOAD_EXIT_DEADLINE_S)
    if failure:
        raise failure[0]


def warm_at_priority() -> WarmedEvent:
    """Answer a `WarmRequest`: warm the compiler at the zygote's nice value, then freeze what
    it imported out of the collector's reach, as after the preload."""
    threads = _native_threads()
    done: list[WarmupResult] = []
    try:
        run_at_priority(lambda: done.append(warm_compiler()), _zygote_nice())
    except Exception as exc:  # ImportError: a torch without inductor; the zygote serves on
        return WarmedEvent(0.0, [], f"{type(exc).__name__}: {exc}")
    gc.freeze()
    left = _native_threads() - threads
    error = f"the warm-up left {left} native threads running" if left > 0 else ""
    return WarmedEvent(done[0].seconds, done[0].skipped, error)


PRELOAD_EXIT_DEADLINE_S = 30.0
"""How long the preload thread may take to end natively after Python's join (its exit hooks
run then; they take microseconds, so only a stalled machine comes near this)."""


def _wait_native_exit(native_id: int, deadline_s: float) -> None:
    """Wait until the thread `native_id` of this process has ended in the kernel's view.

    Python's ``join()`` returns once the thread's Python state is gone; its native thread then
    still runs the thread-exit hooks that libraries registered (MKL's takes a lock). Forking
    before they finish hands the child locks held by a thread it does not have.
    """
    task = f"/proc/self/task/{native_id}"
    if not os.path.isdir("/proc/self/task"):
        return  # not Linux: no way to watch a detached thread end; Python's join has to do
    deadline = time.monotonic() + deadline_s
    pause = 0.0001
    while os.path.exists(task):
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the zygote's preload thread {native_id} has not ended {deadline_s:.0f} s after"
                " its imports finished; forking now could hand workers its locks"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def own_session_at_lowest_weight(nice: int) -> None:
    """Take a session of its own and give that session's autogroup the nice value ``nice``
    (where autogroup scheduling is on, a nice value ranks a process only inside its session's
    group; the caller still sets its own). Also the test suite's CPU burner."""
    try:
        os.setsid()
    except OSError:  # already a session leader
        pass
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:  # no autogroup scheduling here: the thread's nice value is what counts
        pass


def main() -> None:
    """Entry point of the zygote process (``python -m dlrover.agent.zygote_server``)."""
    parser = argparse.ArgumentParser(description="DLRover zygote (started by the agent)")
    parser.add_argument("--fd", type=int, required=True, help="inherited unix socket")
    parser.add_argument("--parent-pid", type=int, required=True, help="the agent's pid")
    parser.add_argument("--preload", default="", help="comma-separated modules to import")
    args = parser.parse_args()
    die_with_parent(args.parent_pid)
    sock = socket.socket(fileno=args.fd)
    started = time.perf_counter()
    preload_at_priority([m for m in args.preload.split(",") if m])
    preload_s = round(time.perf_counter() - started, 4)
    # What was imported lives as long as the workers: out of the collector's reach, their
    # collections (and the interpreter's at their exit) no longer walk it, so neither touches
    # those pages and copies them from the zygote (0.8 -> 0.2 CPU-s for a worker's exit here).
    gc.freeze()
    _send(sock, ReadyEvent(os.getpid(), preload_s, _native_threads()))
    forked = _Server(sock).serve()
    if forked is None:
        # Told to exit (its workers are killed): nothing to save, and tearing down torch in an
        # interpreter at the lowest CPU weight took over the agent's 5 s grace on a busy node.
        os._exit(0)
    run_child(*forked)


if __name__ == "__main__":
    main()
