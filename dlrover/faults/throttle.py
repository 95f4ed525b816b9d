"""The ``slow`` fault made real: the agent holds a worker to 1/factor of a CPU so its steps take longer.

`DLROVER_FAULTS`'s ``slow:node=N:factor=X`` (or ``rank=R``) used to be emulated inside the
script by `maybe_inject` sleeping; a script that does not call it was not slowed at all, and a
sleep is invisible to runtime scores measured in CPU work. Under an agent the worker process
itself is slowed instead, in one of two ways:

- **cpu quota** (cgroup v1 ``cpu`` controller writable): the worker is moved into its own cgroup
  ``<agent's cpu cgroup>/dlrover-slow-<agent pid>-<rank>`` with ``cpu.cfs_quota_us`` =
  ``cpu.cfs_period_us`` / X: at most 1/X of one core, so a single-threaded step (dlrover-run sets
  OMP_NUM_THREADS=1 for several workers per node, as torchrun does) takes X times as long; and
  ``cpu.shares`` = 1024 / X, so on a machine too busy to give anyone a full core it still gets
  1/X of what a sibling process gets. The kernel enforces both for the worker and every process
  it starts afterwards.
- **stop cycle** (elsewhere: no permission, cgroup v2 whose "no internal processes" rule forbids
  a child next to the agent): a thread sends the worker's process group SIGCONT, lets it run
  for ``period / X``, then SIGSTOP for the rest of the period; and the worker's session (its
  autogroup; else its process group) gets the nice value of weight 1/X, because on a busy
  machine the scheduler lets a task that was stopped catch up while it runs.

Either way a sleep is not slowed (time passes while stopped or throttled), CPU work is. The
cgroups are removed when the attempt ends; those of a SIGKILLed agent are removed by the next
agent's `sweep` (their name carries the dead agent's pid).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dlrover.constants import ENV_THROTTLE
from dlrover.faults import Fault, FaultKind, FaultSpecError, parse_faults
from dlrover.processes import pid_alive

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PREFIX = "dlrover-slow-"
STOP_CYCLE_PERIOD_S = 0.1
"""One run + stop cycle of the fallback: short, so a step sees the average rate."""


@dataclass(frozen=True)
class SlowWorker:
    """A worker the slow faults apply to: its global rank, how much slower, from which step."""

    rank: int
    factor: float
    from_step: int


def slow_workers(
    faults: Iterable[Fault], ranks: Iterable[int], restart_count: int, node: tuple[int, int] | None
) -> list[SlowWorker]:
    """The workers of ``ranks`` (this node's global ranks) that slow faults apply to in restart
    ``restart_count`` on ``node`` (slot, attempt): one entry per rank and step a fault starts
    at, with the product of the factors of the rank's faults started by then."""
    slow = [f for f in faults if f.kind is FaultKind.SLOW and f.factor > 1]
    out = []
    for rank in ranks:
        mine = [f for f in slow if f.applies(rank, restart_count, node)]
        for step in sorted({f.step for f in mine}):
            factor = 1.0
            for fault in mine:
                if fault.step <= step:
                    factor *= fault.factor
            out.append(SlowWorker(rank, factor, step))
    return out


class Throttle:
    """Slows the processes given to `add` until `close`; one per attempt."""

    kind = "none"

    def add(self, pid: int, rank: int, factor: float) -> None:
        """Hold process ``pid`` (global rank ``rank``; with its process group for the stop
        cycle) to 1/``factor`` of a CPU."""
        raise NotImplementedError

    def close(self) -> None:
        """Let every process run at full speed again and remove what was made."""


class QuotaThrottle(Throttle):
    """A cgroup v1 ``cpu`` child per worker with a CFS quota of 1/factor of one core."""

    kind = "cpu quota"

    def __init__(self, parent: Path) -> None:
        self._parent = parent
        self._dirs: list[Path] = []

    @classmethod
    def detect(cls, root: Path = CGROUP_ROOT) -> QuotaThrottle | None:
        """A quota throttle under this process's v1 ``cpu`` cgroup, or None where none can be
        made (no v1 cpu controller, no permission)."""
        try:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if "cpu" in controllers.split(","):
                parent = root / controllers / path.lstrip("/")
                if not parent.is_dir():
                    parent = root / "cpu" / path.lstrip("/")
                if (parent / "cpu.cfs_quota_us").exists() and os.access(parent, os.W_OK):
                    return cls(parent)
        return None

    def add(self, pid: int, rank: int, factor: float) -> None:
        """Move ``pid`` into a cgroup allowed ``period / factor`` of CPU per period (a later
        call for the same rank changes its factor)."""
        d = self._parent / f"{PREFIX}{os.getpid()}-{rank}"
        d.mkdir(exist_ok=True)
        if d not in self._dirs:
            self._dirs.append(d)
        period = int((d / "cpu.cfs_period_us").read_text())
        (d / "cpu.cfs_quota_us").write_text(str(max(1000, int(period / factor))))
        # The quota caps it on an idle machine; on a busy one everyone gets less than the cap,
        # and the weight keeps it at 1/factor of what a sibling process gets.
        (d / "cpu.shares").write_text(str(max(2, int(1024 / factor))))
        (d / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        """Remove the cgroups (what still runs in one goes back to the parent first)."""
        for d in self._dirs:
            _remove(d)
        self._dirs.clear()


class StopCycleThrottle(Throttle):
    """SIGCONT, run ``period / factor``, SIGSTOP for the rest of the period, per process group."""

    kind = "stop cycle"

    def __init__(self, period_s: float = STOP_CYCLE_PERIOD_S) -> None:
        self._period_s = period_s
        self._groups: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, pid: int, rank: int, factor: float) -> None:
        """Cycle ``pid``'s process group from now on (the cycling thread starts with the
        first), and lower its scheduling weight to 1/factor."""
        _set_weight(pid, _nice_for(factor))
        with self._lock:
            self._groups[pid] = factor
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="slow-fault", daemon=True)
            self._thread.start()

    def _signal(self, pids: Iterable[int], sig: int) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)  # workers lead their own session: its children too

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                groups = dict(self._groups)
            # Every group runs from the period's start; each stops at its own share.
            self._signal(groups, signal.SIGCONT)
            elapsed = 0.0
            for pid, factor in sorted(groups.items(), key=lambda g: -g[1]):
                share = self._period_s / factor
                if self._stop.wait(max(0.0, share - elapsed)):
                    break
                elapsed = share
                self._signal([pid], signal.SIGSTOP)
            else:
                self._stop.wait(max(0.0, self._period_s - elapsed))
        with self._lock:
            self._signal(self._groups, signal.SIGCONT)

    def close(self) -> None:
        """Stop cycling and SIGCONT every group."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        with self._lock:
            self._signal(self._groups, signal.SIGCONT)  # none is left stopped
            for pid in self._groups:
                _set_weight(pid, 0)
            self._groups.clear()


class SlowFaults:
    """A node's slow faults across its attempts: which workers to throttle, from which step.

    The agent's `WorkerFaults` (dlrover/agent/agent.py), which `dlrover-run` hands it: the agent
    calls `clean_leftovers` as it starts, `start_attempt` once its workers run, `tick` with the
    node's newest step (about every second) and `release` before it stops or judges them (a
    stopped worker would not act on SIGTERM)."""

    def __init__(self, faults_text: str) -> None:
        self._faults: tuple[Fault, ...] = ()
        if "slow" in faults_text:
            try:
                self._faults = parse_faults(faults_text)
            except FaultSpecError as e:  # the workers' injector reports it too
                logger.warning("slow faults not applied: %s", e)
        self._pending: list[SlowWorker] = []
        self._pids: dict[int, int] = {}
        self._throttle: Throttle | None = None

    def clean_leftovers(self) -> None:
        """Remove the throttle cgroups SIGKILLed agents left on this machine (`sweep`)."""
        sweep()

    def start_attempt(
        self,
        rank_offset: int,
        pids: dict[int, int],
        restart_count: int,
        node: tuple[int, int] | None,
    ) -> None:
        """This attempt's workers (local rank -> pid, local rank 0 is global ``rank_offset``)
        have started: throttle those whose fault is due from the start."""
        self.release()
        self._pids = {rank_offset + local: pid for local, pid in pids.items()}
        self._pending = slow_workers(self._faults, self._pids, restart_count, node)
        self.tick(-1)

    def tick(self, step: int) -> None:
        """Throttle each planned slow worker once the node has reached its fault's step."""
        for worker in [w for w in self._pending if w.from_step <= max(step, 0)]:
            self._pending.remove(worker)
            if self._throttle is None:
                self._throttle = make_throttle()
            pid = self._pids[worker.rank]
            try:
                self._throttle.add(pid, worker.rank, worker.factor)
            except OSError as e:
                logger.warning("slow fault on rank %d not applied: %s", worker.rank, e)
                continue
            logger.info(
                "slow fault: rank %d (pid %d) held to 1/%g of a CPU (%s)",
                worker.rank,
                pid,
                worker.factor,
                self._throttle.kind,
            )

    def release(self) -> None:
        """Full speed again for every throttled worker; nothing pending."""
        self._pending = []
        if self._throttle is not None:
            self._throttle.close()
            self._throttle = None


def _nice_for(factor: float) -> int:
    """The nice value whose CFS weight is about 1/factor of nice 0's (each step is x1.25)."""
    return max(0, min(19, round(math.log(factor) / math.log(1.25))))


def _set_weight(pid: int, nice: int) -> None:
    """Give ``pid``'s session (its autogroup, where the kernel groups by session) or its
    process group that nice value; best effort (the process may be gone)."""
    try:
        with open(f"/proc/{pid}/autogroup", "w") as f:
            f.write(str(nice))
        return
    except OSError:
        pass  # no autogroup scheduling: each task's own nice value counts
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PGRP, pid, nice)


def make_throttle(kind: str | None = None) -> Throttle:
    """A quota throttle where a cpu cgroup can be made, else the stop cycle (``kind``, default
    $DLROVER_THROTTLE, forces ``quota`` or ``stop``)."""
    kind = os.environ.get(ENV_THROTTLE, "") if kind is None else kind
    if kind not in ("", "quota", "stop"):
        raise ValueError(f"{ENV_THROTTLE}={kind!r}: use quota, stop or leave it empty")
    if kind != "stop":
        quota = QuotaThrottle.detect()
        if quota is not None:
            return quota
        if kind == "quota":
            raise ValueError(f"{ENV_THROTTLE}=quota: no writable cgroup v1 cpu controller here")
    return StopCycleThrottle()


def _remove(d: Path, deadline_s: float = 2.0) -> None:
    """Remove a throttle cgroup, moving what still runs in it up to the parent first. A worker
    that is still exiting (an OOM-killed one freeing its memory) cannot be moved and keeps the
    cgroup busy: it is asked again until ``deadline_s`` (an agent leaving right after such a
    kill left its cgroup behind for the next agent's sweep)."""
    deadline = time.monotonic() + deadline_s
    while True:
        with contextlib.suppress(OSError):
            for pid in (d / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (d.parent / "cgroup.procs").write_text(pid)
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() >= deadline:
                logger.warning("could not remove the throttle cgroup %s: still busy", d)
                return
        time.sleep(0.05)  # the kernel frees a cgroup once its last task has exited


def sweep(root: Path = CGROUP_ROOT) -> int:
    """Remove the throttle cgroups of agents that are gone (SIGKILLed); returns how many."""
    quota = QuotaThrottle.detect(root)
    if quota is None:
        return 0
    removed = 0
    with contextlib.suppress(OSError):
        for d in quota._parent.iterdir():
            match = re.fullmatch(re.escape(PREFIX) + r"(\d+)-\d+", d.name)
            if match is None or pid_alive(int(match.group(1))):
                continue
            _remove(d)
            removed += not d.exists()
    return removed
