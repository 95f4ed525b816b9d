"""In-process recovery: a peer's failure costs this process the step it hit, not a restart.

Wrap the training function::

    model = build()                       # built once: survives a peer's failure
    compiled = torch.compile(model)       # so do its compiled graphs
    optimizer = torch.optim.AdamW(model.parameters())

    @Wrapper()
    def train() -> None:
        dist.init_process_group("gloo")   # every entry: the world of the current round
        ddp = DistributedDataParallel(compiled)
        state = checkpointer.load_checkpoint()  # the step every rank finished, from memory
        ...

    train()

Under ``dlrover-run`` the wrapper tells its agent that this process recovers in-process. When a
rank elsewhere fails (its process dies, its node is lost) or the world re-forms, the collective
this process waits in fails (or the agent's `Abort` interrupts it), the wrapper destroys the
process groups, waits for the agent's next round, sets the round's environment (RANK,
WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_RESTART_COUNT, ...) and calls the function again:
the model, optimizer, compiled graphs, data-loader workers and (on a GPU) the CUDA context stay.
Only the failed rank's process is replaced (forked from the agent's zygote). The function's
own start — init the process group, load the newest checkpoint — heals every rank to the step
all ranks finished. An error of this process's own (not a collective's) ends the process as
before, and its agent restarts it; without ``dlrover-run`` the function is called once.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

from dlrover.constants import (
    ENV_RECOVERY_JOIN,
    ENV_RECOVERY_SOCKET,
    ENV_VIRTUAL_RANKS,
    ENV_VIRTUAL_WORLD_SIZE,
)
from dlrover.json_messages import MessageError
from dlrover.recovery_channel import (
    Abort,
    AgentMessage,
    Hello,
    NewRound,
    Parked,
    decode_agent_message,
    encode_message,
)
from dlrover.trainer.progress import on_step_end
from dlrover.worker_context import WorkerContext

__all__ = ["DataShare", "InProcessAbort", "Wrapper", "data_share", "recoveries"]

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

DEFAULT_CONFIRM_S = 10.0
"""How long a process whose collective failed waits for its agent to confirm a failure in the
job (`Abort`) before it reports the collective's failure as one of its own."""

DEFAULT_STEP_END_TIMEOUT_S = 10.0
"""How long a request to leave at the end of a step waits before it interrupts the step."""

DEFAULT_ROUND_TIMEOUT_S = 900.0
"""How long a parked process waits for its agent's next round before it gives up (and fails
with the error that parked it, so its agent restarts it the usual way)."""

_COLLECTIVE_ERRORS = (
    "connection closed by peer",
    "connection reset by peer",
    "read error",
    "write error",
    "broken pipe",
    "timed out",
    "timeout",
    "gloo",
    "nccl",
    "socket",
)
"""Words of a failed collective's RuntimeError (gloo, NCCL and the store raise plain ones)."""


class InProcessAbort(BaseException):
    """Raised inside the training function when the agent asks it to stop (the world re-forms);
    a BaseException, so that a script's ``except Exception`` does not swallow it."""


_recoveries = 0


def recoveries() -> int:
    """How many times this process re-entered its wrapped function after a failure."""
    return _recoveries


class _AgentLink:
    """This process's connection to its agent's recovery hub."""

    def __init__(self, path: str, local_rank: int, step_end_timeout_s: float) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(10.0)
        self._sock.connect(path)
        self._sock.settimeout(None)
        self._local_rank = local_rank
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._main = threading.get_ident()
        self._running = False
        self._injected = False
        self.aborted = ""
        """The reason of the agent's last `Abort` since the last round ("" none)."""
        self._round: NewRound | None = None
        self._gone = False
        self._step_end_timeout_s = step_end_timeout_s
        self._at_step_end = False
        """An `Abort` waits for the end of the current step (`StepReporter.report`)."""
        self._seq = 0
        """Messages taken so far: a step-end timer acts only if no message came after its own."""
        self._reader = threading.Thread(target=self._read, name="dlrover-recovery", daemon=True)
        self._reader.start()
        self._remove_hook = on_step_end(self._step_ended)

    def hello(self, shrink: bool) -> None:
        """Tell the agent this process recovers in-process (a replacement: that it is ready)."""
        self._send(Hello(self._local_rank, os.getpid(), shrink))

    def _send(self, message: Hello | Parked) -> None:
        self._sock.sendall(encode_message(message))

    def _read(self) -> None:
        try:
            for line in self._sock.makefile("rb"):
                self._on(decode_agent_message(line))
        except (OSError, MessageError, ValueError) as e:
            log.warning("the link to the agent ended: %s", e)
        with self._cond:
            self._gone = True
            self._cond.notify_all()

    def _on(self, message: AgentMessage) -> None:
        with self._cond:
            self._seq += 1
            if isinstance(message, Abort):
                self.aborted = message.reason or "the agent asked"
                if message.at_step_end and self._step_end_timeout_s > 0:
                    self._at_step_end = True
                    timer = threading.Timer(self._step_end_timeout_s, self._inject, (self._seq,))
                    timer.daemon = True
                    timer.start()
                else:
                    self._at_step_end = False
                    self._inject_locked()
            elif isinstance(message, NewRound):
                # What came before this round was answered by it; an Abort after it stands.
                self._round, self.aborted, self._at_step_end = message, "", False
            self._cond.notify_all()

    def _inject(self, seq: int) -> None:
        """The step-end wait of the `Abort` numbered ``seq`` is over: interrupt the step."""
        with self._cond:
            if seq == self._seq:
                self._inject_locked()

    def _inject_locked(self) -> None:
        if self._running and not self._injected and self.aborted:
            self._injected = True
            _raise_in(self._main, InProcessAbort)

    def _step_ended(self, step: int) -> None:
        """After each reported step: leave now if an `Abort` waits for the end of a step."""
        if threading.get_ident() != self._main:
            return
        with self._cond:
            leave = self._at_step_end and self._running and not self._injected
            if leave:
                self._running = False  # raised here: no injection may follow
        if leave:
            raise InProcessAbort(f"{self.aborted} (after step {step})")

    def enter(self) -> bool:
        """The training function runs: an `Abort` interrupts it. True: one came before it was
        entered (and asks to leave at once): do not enter it."""
        with self._cond:
            self._running, self._injected = True, False
            if self.aborted and not self._at_step_end:
                self._running = False
                return True
            return False

    def leave(self) -> None:
        """The training function returned or raised: no `Abort` may land in the wrapper."""
        while True:
            try:
                with self._cond:
                    self._running = False
                    if self._injected:
                        _raise_in(self._main, None)  # one sent but not raised yet: cancel it
                return
            except InProcessAbort:  # raised between two bytecodes of this method
                continue

    def wait_abort(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the agent's `Abort` (a failure it knows of)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self.aborted and not self._gone:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return bool(self.aborted)

    def park(self, error: str, timeout: float) -> NewRound | None:
        """Say `Parked` and wait for the next round (None: the agent is gone or silent)."""
        with self._cond:
            self._round = None
        try:
            self._send(Parked(self._local_rank, error[:2000]))
        except OSError:
            return None
        return self.wait_round(timeout)

    def wait_round(self, timeout: float) -> NewRound | None:
        """The next round from the agent, within ``timeout`` (None: the agent is gone or
        silent)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._round is None and not self._gone:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._round

    def close(self) -> None:
        """End the link (the agent sees the worker leave)."""
        self._remove_hook()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in the thread at its next bytecode (None: cancel one pending)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None
    )


def _is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is what a collective or the store raises when a peer fails."""
    if isinstance(exc, InProcessAbort):
        return True
    try:
        import torch.distributed as dist

        if isinstance(exc, dist.DistError):
            return True
    except ImportError:
        pass
    if isinstance(exc, (RuntimeError, ConnectionError, TimeoutError)):
        text = str(exc).lower()
        return any(word in text for word in _COLLECTIVE_ERRORS)
    return False


def _release_process_groups() -> str | None:
    """Abort (NCCL) and destroy every process group; the default group's backend, or None if
    there was none."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    backend = str(dist.get_backend())
    if "nccl" in backend:
        # A pending NCCL kernel would hold the communicator: abort it first (on a GPU only;
        # this path is not exercised by the CPU test suite).
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception as e:  # the destroy below still runs
            log.warning("aborting the NCCL process group failed: %s", e)
    try:
        dist.destroy_process_group()
    except Exception as e:  # a group broken by the failure: drop what is left
        log.warning("destroying the process group after the failure: %s", e)
    return backend


@dataclass(frozen=True)
class DataShare:
    """The part of the global batch this process trains on in the current round."""

    ranks: tuple[int, ...]
    """Ranks of the full layout (nodes x --nproc-per-node) whose data this process takes: its
    own, plus those of failed local ranks while its node goes on without them."""
    world_size: int
    """The full layout's world size: what the global batch is split by."""
    scale: float
    """Multiply each of ``ranks``' losses by this: DDP's mean over the ranks of the round then
    equals the mean over the full layout (exact where it is a power of two)."""


def data_share() -> DataShare:
    """This process's part of the global batch now (``DLROVER_VIRTUAL_RANKS``); without
    dlrover-run: its own rank of WORLD_SIZE."""
    ctx = WorkerContext.from_env()
    text = os.environ.get(ENV_VIRTUAL_RANKS, "")
    ranks = tuple(int(r) for r in text.split(",") if r.strip()) if text else (ctx.rank,)
    full = int(os.environ.get(ENV_VIRTUAL_WORLD_SIZE, "") or ctx.world_size)
    return DataShare(ranks, full, ctx.world_size / full)


class Wrapper:
    """Calls the wrapped training function again, in the same process, after a failure.

    ``shrink``: when a rank of this node fails, go on at once without it, taking its data
    (`data_share`), instead of waiting until its replacement has started and built its model;
    the replacement joins at the end of a step once it is ready. Only for replicated state
    (DDP): a sharded state (FSDP) needs every rank. ``warmup``: what a replacement runs before
    it says it is ready (a forward and backward of the compiled model on a sample batch, with
    the loss it trains with: the backward's graph depends on it; so that its first step with
    the others does not compile). ``round_timeout_s``: how long a
    parked process waits for the next round before it fails with the error that parked it
    (its agent then restarts it, the usual way). ``confirm_s``: how long a process whose
    collective failed waits for its agent to name a failure in the job; without one the
    collective's failure counts as this node's (it uses up a restart). ``step_end_timeout_s``:
    how long a request to leave at the end of a step waits for the script's next
    `StepReporter.report` before it interrupts the step.
    """

    def __init__(
        self,
        shrink: bool = False,
        warmup: Callable[[], object] | None = None,
        round_timeout_s: float = DEFAULT_ROUND_TIMEOUT_S,
        confirm_s: float = DEFAULT_CONFIRM_S,
        step_end_timeout_s: float = DEFAULT_STEP_END_TIMEOUT_S,
    ) -> None:
        if round_timeout_s <= 0 or confirm_s < 0 or step_end_timeout_s < 0:
            raise ValueError(
                "need round_timeout_s > 0, confirm_s >= 0 and step_end_timeout_s >= 0, got "
                f"{round_timeout_s}, {confirm_s}, {step_end_timeout_s}"
            )
        self.shrink = shrink
        self.warmup = warmup
        self.round_timeout_s = round_timeout_s
        self.confirm_s = confirm_s
        self.step_end_timeout_s = step_end_timeout_s

    def __call__(self, fn: Callable[P, R]) -> Callable[P, R]:
        """``fn`` wrapped: called again in this process after each recovered failure."""

        @functools.wraps(fn)
        def wrapped(*args: P.args, **kwargs: P.kwargs) -> R:
            return self._run(fn, args, kwargs)

        return wrapped

    def _run(self, fn: Callable[..., R], args: Any, kwargs: Any) -> R:
        global _recoveries
        path = os.environ.get(ENV_RECOVERY_SOCKET, "")
        if not path:
            return fn(*args, **kwargs)  # not under dlrover-run: nobody to recover with
        joining = os.environ.get(ENV_RECOVERY_JOIN) == "1"
        if joining and self.warmup is not None:
            started = time.monotonic()
            self.warmup()
            log.info("warmed up in %.3fs", time.monotonic() - started)
        try:
            link = _AgentLink(path, WorkerContext.from_env().local_rank, self.step_end_timeout_s)
            link.hello(self.shrink)
        except OSError as e:
            if joining:
                raise RuntimeError(f"a replacement cannot reach its agent at {path}: {e}") from e
            log.warning("in-process recovery is off: cannot reach the agent at %s (%s)", path, e)
            return fn(*args, **kwargs)
        import torch.distributed as dist

        # A group the script made before calling: the wrapper makes it again for each round.
        outer_backend = str(dist.get_backend()) if dist.is_initialized() else None
        try:
            if joining:  # a replacement: its round comes once the others reach a step's end
                first = link.wait_round(self.round_timeout_s)
                if first is None:
                    raise RuntimeError(
                        f"in-process recovery: this replacement got no round from its agent "
                        f"within {self.round_timeout_s:.0f}s"
                    )
                _apply(first.env)
            while True:
                if link.enter():
                    why = link.aborted  # asked to leave before the function was entered
                else:
                    try:
                        try:
                            result = fn(*args, **kwargs)
                        finally:
                            link.leave()
                        return result
                    except BaseException as exc:
                        if not (link.aborted or _is_collective_failure(exc)):
                            raise  # this process's own error: it fails, its agent restarts it
                        why = link.aborted or f"{type(exc).__name__}: {exc}"
                        if not link.aborted and link.wait_abort(self.confirm_s):
                            why = f"{link.aborted} ({why})"
                started = time.monotonic()
                log.warning("leaving the training step: %s", why.splitlines()[0][:300])
                _release_process_groups()
                nxt = link.park(why, self.round_timeout_s)
                if nxt is None:
                    raise RuntimeError(
                        f"in-process recovery: no new round from the agent within "
                        f"{self.round_timeout_s:.0f}s after: {why}"
                    )
                _apply(nxt.env)
                if outer_backend is not None:
                    dist.init_process_group(outer_backend)
                _recoveries += 1
                log.warning(
                    "in-process recovery %d: round %d, rank %s of %s, back in %.3fs",
                    _recoveries,
                    nxt.round,
                    os.environ.get("RANK", "?"),
                    os.environ.get("WORLD_SIZE", "?"),
                    time.monotonic() - started,
                )
        finally:
            link.close()


def _apply(env: dict[str, str]) -> None:
    """Set a round's variables in this process's environment ("" removes one)."""
    for key, value in env.items():
        if value:
            os.environ[key] = value
        else:
            os.environ.pop(key, None)
