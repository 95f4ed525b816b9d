"""Fault injection for training scripts and tests: `maybe_inject(step)` fires what DLROVER_FAULTS asks.

The syntax of DLROVER_FAULTS and its parser live in `dlrover.faults` (the agent's node check
reads it too); this module is what runs them: kill, raise, hang, slow, exit, kill_agent, freeze_node,
lose_node, kill_master, fill_disk, oom.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

from dlrover import worker_context
from dlrover.checkpoint.config import shm_dirs_from_env
from dlrover.checkpoint.leftovers import parse as parse_owned
from dlrover.constants import ENV_JOB_NAME, ENV_NODE_ID, ENV_NODE_MEMORY_LIMIT_MIB
from dlrover.faults import (
    ENV_AGENT_PID,
    ENV_FAULTS,
    Fault,
    FaultKind,
    FaultSpecError,
    node_check_faults,
    node_slot,
    parse_fault,
    parse_faults,
)

__all__ = [
    "ENV_AGENT_PID",
    "ENV_FAULTS",
    "OOM_MAX_BYTES",
    "Fault",
    "FaultInjector",
    "FaultKind",
    "FaultSpecError",
    "InjectedFault",
    "maybe_inject",
    "node_check_faults",
    "node_slot",
    "parse_fault",
    "parse_faults",
]

OOM_MAX_BYTES = 64 << 30
"""The oom fault gives up (MemoryError) after this much without being killed (after twice
the node's memory limit where the engine set one, DLROVER_NODE_MEMORY_LIMIT_MIB)."""


class InjectedFault(RuntimeError):
    """The exception the ``raise`` fault throws."""


class FaultInjector:
    """Fires the faults meant for one worker (its rank and restart count) at their steps."""

    def __init__(
        self,
        faults: tuple[Fault, ...],
        rank: int,
        restart_count: int,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        agent_pid: int | None = None,
        node: tuple[int, int] | None = None,
        slow_by_agent: bool = False,
    ) -> None:
        # Under a dlrover agent, slow faults throttle the process itself
        # (dlrover/faults/throttle.py); sleeping here too would slow it twice.
        self._faults = tuple(
            fault
            for fault in faults
            if fault.applies(rank, restart_count, node)
            and fault.kind is not FaultKind.COLLECTIVE_FAIL
            and not (slow_by_agent and fault.kind is FaultKind.SLOW)
        )
        self._rank = rank
        self._clock = clock
        self._sleep = sleep
        self._agent_pid = agent_pid
        self._last_call: float | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> FaultInjector:
        """The injector of this process: faults from DLROVER_FAULTS, rank and restart count from the
        worker environment, the agent's pid from DLROVER_AGENT_PID (whose agent applies the slow
        faults: the injector then leaves them out). Raises FaultSpecError for a malformed fault
        list."""
        env = os.environ if env is None else env
        agent = env.get(ENV_AGENT_PID, "")
        return cls(
            parse_faults(env.get(ENV_FAULTS, "")),
            rank=int(env.get(worker_context.RANK, "0")),
            restart_count=int(env.get(worker_context.RESTART_COUNT, "0")),
            agent_pid=int(agent) if agent.isdigit() else None,
            node=node_slot(env.get(ENV_NODE_ID, "")),
            slow_by_agent=agent.isdigit(),
        )

    @property
    def faults(self) -> tuple[Fault, ...]:
        """The faults that apply to this worker."""
        return self._faults

    def maybe_inject(self, step: int) -> None:
        """Call once per step, before or after the step's work; fires what is due at `step`."""
        # The step's own work: the time since the previous call returned (after its sleep).
        step_time = None if self._last_call is None else self._clock() - self._last_call
        injected_sleep = 0.0
        for fault in self._faults:
            if fault.kind is FaultKind.SLOW:
                if step >= fault.step and step_time is not None and fault.factor > 1:
                    injected_sleep += (fault.factor - 1) * step_time
            elif step == fault.step and fault.claim():
                self._fire(fault, step)
        if injected_sleep:
            self._sleep(injected_sleep)
        self._last_call = self._clock()

    def _announce(self, fault: Fault, step: int) -> None:
        # One line on stderr: the log shows the failure was planned, tests can wait for it.
        print(
            f"dlrover fault injection: {fault.kind.value} rank {self._rank} step {step}",
            file=sys.stderr,
            flush=True,
        )

    def _fire(self, fault: Fault, step: int) -> None:
        self._announce(fault, step)
        if fault.kind is FaultKind.RAISE:
            raise InjectedFault(f"injected fault at step {step} on rank {self._rank}")
        sys.stdout.flush()
        if fault.kind is FaultKind.KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind is FaultKind.EXIT:
            os._exit(fault.code)
        elif fault.kind is FaultKind.KILL_AGENT:
            if self._agent_pid is None:
                raise FaultSpecError(f"kill_agent needs {ENV_AGENT_PID} set by the agent")
            os.kill(self._agent_pid, signal.SIGKILL)
        elif fault.kind is FaultKind.LOSE_NODE:
            if self._agent_pid is None:
                raise FaultSpecError(f"lose_node needs {ENV_AGENT_PID} set by the agent")
            os.kill(self._agent_pid, signal.SIGKILL)
            # The node's memory goes with it: its segments, wherever the saver kept them.
            for folder in filter(None, shm_dirs_from_env()):
                for name in os.listdir(folder):
                    owned = parse_owned(name)
                    if owned is not None and owned.pid == self._agent_pid:
                        with contextlib.suppress(OSError):  # gone, or a folder (not memory)
                            os.unlink(os.path.join(folder, name))
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind is FaultKind.FREEZE_NODE:
            if self._agent_pid is None:
                raise FaultSpecError(f"freeze_node needs {ENV_AGENT_PID} set by the agent")
            os.kill(self._agent_pid, signal.SIGSTOP)  # no heartbeat, no restart of anything
            os.kill(os.getpid(), signal.SIGSTOP)  # its peers on the node block on it
        elif fault.kind is FaultKind.KILL_MASTER:
            os.kill(_master_pid(), signal.SIGKILL)
        elif fault.kind is FaultKind.FILL_DISK:
            fill_disk(fault.path, DEFAULT_FILL_S if fault.seconds is None else fault.seconds)
        elif fault.kind is FaultKind.OOM:
            hog = []
            chunk = 64 << 20
            limit = os.environ.get(ENV_NODE_MEMORY_LIMIT_MIB, "")
            # Bounded: no limit means no OOM kill, and an unkilled hog must not take the host.
            most = min(OOM_MAX_BYTES, 2 * int(limit) << 20) if limit.isdigit() else OOM_MAX_BYTES
            for _ in range(most // chunk):
                block = bytearray(chunk)
                block[::4096] = b"\x01" * (chunk // 4096)  # touch every page
                hog.append(block)
            raise MemoryError(f"oom fault: {most >> 20} MiB allocated and no OOM kill")
        elif fault.kind is FaultKind.HANG:
            if fault.seconds is not None:
                self._sleep(fault.seconds)
                return
            while True:  # until the agent's hang detection (or the test) kills us
                self._sleep(3600)


DEFAULT_FILL_S = 5.0
"""How long fill_disk keeps the filesystem full when the fault gives no ``seconds``."""

_REMOVE_LATER = "import os, sys, time\ntime.sleep(float(sys.argv[1]))\nos.unlink(sys.argv[2])\n"


def fill_disk(folder: str, seconds: float) -> str:
    """Fill the filesystem of ``folder`` with one file until ENOSPC, and have a process of its
    own (it outlives this one, which may be killed meanwhile) remove the file ``seconds``
    later (``inf``: never; it goes with its filesystem). Returns the file's path."""
    path = os.path.join(folder, f".dlrover-fill-{os.getpid()}")
    chunk = b"\0" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                os.unlink(path)
                raise
        with contextlib.suppress(OSError):  # the last pages that fit (at most a chunk)
            for _ in range(len(chunk) // 4096):
                f.write(chunk[:4096])
    if math.isinf(seconds):
        return path
    # Detached, and holding none of this process's pipes: a reader waiting for their end
    # (a launcher, a test) must not wait for it.
    subprocess.Popen(
        [sys.executable, "-c", _REMOVE_LATER, str(seconds), path],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    return path


def _master_pid() -> int:
    """The pid of this job's master from its `dlrover submit` record (DLROVER_JOB_NAME under
    DLROVER_HOME); FaultSpecError where there is none (a job not started by `dlrover submit`)."""
    # Imported here: the job records bring the master's message types, which a worker that
    # injects any other fault would import on every start for nothing.
    from dlrover.runner.records import NoSuchJobError, read_record

    name = os.environ.get(ENV_JOB_NAME, "")
    try:
        record = read_record(name) if name else None
    except NoSuchJobError as exc:
        raise FaultSpecError(f"kill_master needs a job of `dlrover submit`: {exc}") from None
    if record is None or record.ended or record.pid <= 0:
        raise FaultSpecError(
            f"kill_master needs the running master of a `dlrover submit` job ({ENV_JOB_NAME}="
            f"{name!r} names {'no job' if record is None else 'an ended one'})"
        )
    return record.pid


def maybe_inject(step: int, cache: dict[str, FaultInjector] | None = None) -> None:
    """Convenience for scripts: ``maybe_inject(step)`` each step, configured by the environment.

    The injector lives in `cache` (by default a per-process dict in this module), keyed by the
    environment that configured it, because slow faults measure the time between calls.
    """
    key = "|".join(
        os.environ.get(name, "")
        for name in (
            ENV_FAULTS,
            worker_context.RANK,
            worker_context.RESTART_COUNT,
            ENV_AGENT_PID,
            ENV_NODE_ID,
        )
    )
    store = _INJECTORS if cache is None else cache
    injector = store.get(key)
    if injector is None:
        injector = store[key] = FaultInjector.from_env()
    injector.maybe_inject(step)


_INJECTORS: dict[str, FaultInjector] = {}
