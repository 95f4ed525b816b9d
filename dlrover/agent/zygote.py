"""Fast worker start: fork workers from a template process that already imported torch.

The agent starts one `Zygote` per node. Each `spawn` asks it (JSON lines over a unix socket:
``zygote_messages.py``) to fork a worker that runs the user's script as ``__main__`` with the
given argv, env and cwd, so a restarted worker skips ``import torch`` and the lazy imports of
the first DDP/optimizer construction. Its stdout and stderr are the agent's own open files
(sent as descriptors with the request), so its output lands where a Popen child's would. The agent (``workers.py``) starts a worker
with Popen instead when the zygote cannot be started, is gone or refuses.

Exits: the zygote is the workers' parent; it waits on a pidfd per worker, reaps it and
reports the Popen-style return code on the socket at once, where a reader thread in the
agent resolves the `WorkerHandle` (milliseconds, no polling). Kills: every worker leads its
own process group, so `WorkerHandle.kill` reaches everything it started. Lifetime: the zygote
dies with the agent and workers die with the zygote (PR_SET_PDEATHSIG), so nothing is orphaned.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Union

from dlrover.agent.zygote_messages import (
    FDS_MARKER,
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
    ZygoteRequest,
    decode_event,
    encode_request,
)
from dlrover.json_messages import MessageError

log = logging.getLogger(__name__)

DEFAULT_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.optim",
    "torch._dynamo",
)
"""Modules a DDP worker imports before its first step (torch._dynamo: lazily, by the optimizer)."""

# Read once by native libraries when they load: a worker's own value is applied after fork,
# so the zygote itself starts without them (its defaults are then those of a fresh process).
WARM_TIMEOUT_S = 60.0
"""What a spawn sent while the zygote warms the compiler may wait beyond its own timeout (the
warm-up takes about 1.5 s with a warm cache, 5 s on a fresh one, longer on a busy node)."""

_ZYGOTE_UNSET_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])


Output = Union[int, str, "os.PathLike[str]"]
"""Where a forked worker's stdout or stderr goes: an open descriptor to share, or a path to append
to."""


@contextmanager
def _output_fds(stdout: Output, stderr: Output) -> Iterator[list[int]]:
    """The two descriptors to send; the ones opened here (paths) are closed afterwards (the
    zygote holds its own references once they are sent)."""
    opened: list[int] = []
    fds: list[int] = []
    try:
        for target in (stdout, stderr):
            if isinstance(target, int):
                fds.append(target)
                continue
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
            opened.append(fd)
            fds.append(fd)
        yield fds
    finally:
        for fd in opened:
            os.close(fd)


class ZygoteError(Exception):
    """The zygote could not be started, refused a spawn, or is gone."""


class WorkerHandle(ABC):
    """A started worker process. Return codes follow Popen: -N means killed by signal N."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._done = threading.Event()
        self._returncode: int | None = None
        self._callbacks: list[Callable[[WorkerHandle], None]] = []
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        """The return code, or None while the worker runs."""
        return self._returncode if self._done.is_set() else None

    def wait(self, timeout: float) -> int | None:
        """Block up to `timeout` seconds for the exit; the return code, or None if still running."""
        self._done.wait(timeout)
        return self.poll()

    def add_exit_callback(self, callback: Callable[[WorkerHandle], None]) -> None:
        """Call `callback(handle)` once the worker has exited (at once if it already has).

        Callbacks run on an internal thread: keep them short (set an event, queue a message).
        """
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(callback)
                return
        callback(self)

    def remove_exit_callback(self, callback: Callable[[WorkerHandle], None]) -> None:
        """Forget a callback that has not run yet (no-op otherwise)."""
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the worker's whole process group; a no-op once everything is gone."""
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    @property
    @abstractmethod
    def forked(self) -> bool:
        """True when forked from the zygote, False when started by Popen."""

    def _resolve(self, returncode: int) -> None:
        with self._lock:
            if self._done.is_set():
                return
            self._returncode = returncode
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback(self)
            except Exception:
                log.exception("exit callback of worker %d failed", self.pid)


class ForkedWorker(WorkerHandle):
    """A worker forked by the zygote; its exit arrives as a message from the zygote."""

    @property
    def forked(self) -> bool:
        """Always True: the zygote forked it."""
        return True


class PopenWorker(WorkerHandle):
    """A worker started with Popen; a thread blocked in wait() reports its exit."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        super().__init__(process.pid)
        self._process = process
        threading.Thread(target=self._watch, name=f"worker-{self.pid}", daemon=True).start()

    @property
    def forked(self) -> bool:
        """Always False: started afresh with Popen."""
        return False

    def _watch(self) -> None:
        self._resolve(self._process.wait())


def with_package_on_path(env: dict[str, str]) -> dict[str, str]:
    """``env`` with this dlrover on PYTHONPATH, so that a child process can import
    ``dlrover.agent.bootstrap`` (or the zygote server) from a source checkout too."""
    entries = [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]
    if _PACKAGE_ROOT not in entries:
        env["PYTHONPATH"] = os.pathsep.join([*entries, _PACKAGE_ROOT])
    return env


class Zygote:
    """Client of one zygote process. Thread-safe; `close()` ends it and its workers."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        sock: socket.socket,
        reader: IO[bytes],
        ready: ReadyEvent,
    ) -> None:
        self._process = process
        self._sock = sock
        self.preload_s = ready.preload_s
        """Seconds the zygote spent importing the preloaded modules."""
        self.native_threads = ready.threads
        """Native threads in the zygote after preloading (informational)."""
        self._send_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._next_id = 0
        # request id -> (answered, [the ForkedWorker, or why the spawn failed])
        self._pending: dict[int, tuple[threading.Event, list[ForkedWorker | str]]] = {}
        self._workers: dict[int, ForkedWorker] = {}
        self._lost = False
        self._warmed = threading.Event()
        self._warm_asked = False
        self.warmup: WarmedEvent | None = None
        """The zygote's answer to `warm_compiler` (None until it came)."""
        self._reader_file = reader
        self._reader = threading.Thread(target=self._read_events, name="zygote-reader", daemon=True)
        self._reader.start()

    @classmethod
    def start(
        cls,
        preload: Sequence[str] = DEFAULT_PRELOAD,
        timeout: float = 60.0,
        env: Mapping[str, str] | None = None,
    ) -> Zygote:
        """Start a zygote that imports `preload`; raises ZygoteError if not ready in `timeout`."""
        return cls.begin(preload, env).result(timeout)

    @classmethod
    def begin(
        cls,
        preload: Sequence[str] = DEFAULT_PRELOAD,
        env: Mapping[str, str] | None = None,
    ) -> PendingZygote:
        """Start the zygote process and return at once; `result()` waits for its preload.

        Call it from a thread that lives as long as the agent: the zygote's death signal is
        tied to the thread that started it.
        """
        bad = [name for name in preload if not name or "," in name]
        if bad:
            raise ZygoteError(f"invalid module names to preload: {bad!r}")
        zygote_env = {
            key: value
            for key, value in (os.environ if env is None else env).items()
            if key not in _ZYGOTE_UNSET_ENV
        }
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dlrover.agent.zygote_server",
                    "--fd",
                    str(theirs.fileno()),
                    "--parent-pid",
                    str(os.getpid()),
                    "--preload",
                    ",".join(preload),
                ],
                env=with_package_on_path(zygote_env),
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        return PendingZygote(process, ours, list(preload))

    @property
    def pid(self) -> int:
        """The zygote process's pid."""
        return self._process.pid

    @property
    def alive(self) -> bool:
        """Whether the zygote still runs and its channel is intact (it can fork)."""
        return not self._lost and self._process.poll() is None

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str | os.PathLike[str],
        stdout: Output,
        stderr: Output,
        timeout: float = 10.0,
        unbuffered: bool = False,
    ) -> ForkedWorker:
        """Fork a worker running `argv` (``[script, args...]`` or ``["-m", module, args...]``).

        `env` is the worker's complete environment (the torchrun contract included); it
        replaces the zygote's. `stdout` and `stderr` are each an open file descriptor, which
        the worker then shares (same open file: offset and O_APPEND, as a Popen child that
        inherits it), or a path, opened here for appending. `unbuffered` is ``python -u``
        (PYTHONUNBUFFERED in `env` has the same effect). Raises ZygoteError when the zygote
        refuses (the message says why) or does not answer within `timeout`.
        """
        with self._state_lock:
            if self._lost:
                raise ZygoteError("the zygote is gone; start a new one or use Popen")
            request_id = self._next_id
            self._next_id += 1
            answered = threading.Event()
            answer: list[ForkedWorker | str] = []
            self._pending[request_id] = (answered, answer)
        request = SpawnRequest(
            request_id=request_id,
            argv=list(argv),
            env=dict(env),
            cwd=os.fspath(os.path.abspath(cwd)),
            unbuffered=unbuffered,
        )
        try:
            with _output_fds(stdout, stderr) as fds:
                self._send(request, fds)
        except (ZygoteError, OSError) as exc:
            with self._state_lock:
                self._pending.pop(request_id, None)
            if isinstance(exc, ZygoteError):
                raise
            raise ZygoteError(f"cannot open the worker's output: {exc}") from exc
        if self._warm_asked and not self._warmed.is_set():
            # The zygote answers requests in order: this spawn waits for the warm-up first.
            timeout += WARM_TIMEOUT_S
        if not answered.wait(timeout):
            with self._state_lock:
                self._pending.pop(request_id, None)
            raise ZygoteError(f"zygote {self.pid} did not answer a spawn within {timeout} s")
        result = answer[0]
        if isinstance(result, ForkedWorker):
            return result
        raise ZygoteError(f"zygote refused to spawn {list(argv)!r}: {result}")

    def warm_compiler(self) -> None:
        """Ask the zygote to warm inductor's compiler for the workers it forks from now on
        (`dlrover.agent.compiler_warmup`); returns at once. Spawns sent meanwhile wait for it.
        Its answer is logged and kept in `warmup`. Raises ZygoteError when the zygote is gone."""
        self._send(WarmRequest())
        self._warm_asked = True

    def wait_warmed(self, timeout: float) -> WarmedEvent | None:
        """The answer to `warm_compiler` once it came within `timeout`, else None."""
        self._warmed.wait(timeout)
        return self.warmup

    def close(self, timeout: float = 5.0) -> None:
        """Stop the zygote; its remaining workers are killed. Waits at most `timeout` seconds."""
        try:
            self._send(ExitRequest())
        except ZygoteError:
            pass
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("zygote %d did not exit within %.1f s; killing it", self.pid, timeout)
            self._process.kill()
            self._process.wait(timeout)
        self._sock.close()
        self._reader.join(timeout)

    def _send(self, request: ZygoteRequest, fds: Sequence[int] = ()) -> None:
        try:
            data = encode_request(request)
        except MessageError as exc:
            raise ZygoteError(
                f"malformed {request.op} request for zygote {self.pid}: {exc}"
            ) from exc
        with self._send_lock:
            try:
                # One sendmsg per marked line: the zygote pairs descriptor groups with marked
                # lines in order.
                if fds:
                    data = FDS_MARKER + data
                sent = socket.send_fds(self._sock, [data], list(fds)) if fds else 0
                self._sock.sendall(data[sent:])
            except OSError as exc:
                raise ZygoteError(f"zygote {self.pid} is gone: {exc}") from exc

    def _read_events(self) -> None:
        try:
            for line in self._reader_file:
                self._dispatch(decode_event(line))
        except (OSError, ValueError) as exc:  # ValueError: a malformed line (MessageError)
            log.warning("zygote %d: reading events failed: %s", self.pid, exc)
        self._on_lost()

    def _dispatch(self, event: ZygoteEvent) -> None:
        if isinstance(event, ExitedEvent):
            with self._state_lock:
                worker = self._workers.pop(event.pid, None)
            if worker is not None:
                worker._resolve(event.returncode)
        elif isinstance(event, (SpawnedEvent, SpawnFailedEvent)):
            with self._state_lock:
                pending = self._pending.pop(event.request_id, None)
                result: ForkedWorker | str
                if isinstance(event, SpawnedEvent):
                    result = ForkedWorker(event.pid)
                    self._workers[result.pid] = result
                else:
                    result = event.error
            if pending is not None:
                pending[1].append(result)
                pending[0].set()
        elif isinstance(event, WarmedEvent):
            self.warmup = event
            self._warmed.set()
            if event.error:
                log.warning("zygote %d: warming the compiler: %s", self.pid, event.error)
            else:
                log.info(
                    "zygote %d: compiler warmed in %.2f s; restarted workers skip that%s",
                    self.pid,
                    event.seconds,
                    f" (not warmed: {', '.join(event.skipped)})" if event.skipped else "",
                )
        elif isinstance(event, ErrorEvent):
            log.warning("zygote %d: %s", self.pid, event.error)
        else:
            log.warning("zygote %d: unexpected %s", self.pid, event)

    def _on_lost(self) -> None:
        # The zygote is gone: its workers died with it (PDEATHSIG), as if SIGKILLed.
        with self._state_lock:
            self._lost = True
            workers, self._workers = list(self._workers.values()), {}
            pending, self._pending = list(self._pending.values()), {}
        for worker in workers:
            worker.kill()
            worker._resolve(-signal.SIGKILL)
        for answered, answer in pending:
            answer.append("the zygote exited")
            answered.set()


class PendingZygote:
    """A zygote process that is still importing its preload."""

    def __init__(self, process: subprocess.Popen[bytes], sock: socket.socket, preload: list[str]):
        self._process = process
        self._sock = sock
        self._preload = preload
        self._result: Zygote | None = None

    @property
    def pid(self) -> int:
        """The zygote process's pid (importing or ready)."""
        return self._process.pid

    @property
    def done(self) -> bool:
        """Whether `result()` has returned the ready zygote already."""
        return self._result is not None

    def wait_ready(self, timeout: float) -> bool:
        """Whether the zygote has finished its preload (or failed) within `timeout`; it is left
        running either way."""
        if self._result is not None:
            return True
        readable, _, _ = select.select([self._sock], [], [], max(0.0, timeout))
        return bool(readable)

    def result(self, timeout: float = 60.0) -> Zygote:
        """Wait up to `timeout` for the preload; raises ZygoteError (and ends it) if not ready."""
        if self._result is not None:
            return self._result
        self._sock.settimeout(timeout)
        reader = self._sock.makefile("rb")
        try:
            line = reader.readline()
        except (TimeoutError, OSError):
            line = b""
        self._sock.settimeout(None)
        if not line:
            self.cancel()
            raise ZygoteError(
                f"zygote did not become ready within {timeout:.0f} s (exit {self._process.returncode});"
                f" preload {self._preload} failed? see the agent's stderr"
            )
        try:
            ready = decode_event(line)
        except MessageError as exc:
            self.cancel()
            raise ZygoteError(f"zygote {self._process.pid} did not start cleanly: {exc}") from exc
        if not isinstance(ready, ReadyEvent):
            self.cancel()
            raise ZygoteError(f"zygote {self._process.pid} sent {ready} before it was ready")
        log.info(
            "zygote %d ready: preloaded %s in %.2f s",
            self._process.pid,
            ",".join(self._preload),
            ready.preload_s,
        )
        self._result = Zygote(self._process, self._sock, reader, ready)
        return self._result

    def cancel(self) -> None:
        """End a zygote that is not (or no longer) wanted."""
        if self._result is not None:
            self._result.close()
            return
        self._process.kill()
        self._process.wait(timeout=10)
        self._sock.close()
