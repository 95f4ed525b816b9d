"""Watching one attempt's workers: exits, progress, hangs and membership, as one `Outcome`."""

from __future__ import annotations

import enum
import logging
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dlrover.agent.bootstrap import read_script_result
from dlrover.agent.collectives import ask_dump
from dlrover.agent.config import AgentConfig
from dlrover.agent.hang_watch import Hang, HangWatch
from dlrover.agent.launch_plan import LaunchPlan
from dlrover.agent.progress_watch import ExitWatch, ProgressWatch, Stall, StepBreakdown, StepTimes
from dlrover.agent.stacks import collect_stacks, cpu_seconds, is_stopped
from dlrover.agent.workers import WorkerExit, WorkerGroup
from dlrover.collectives import laggards
from dlrover.hang_spec import PhaseHistory
from dlrover.trainer.progress import read_sections, read_step_file

STACK_LINES = 30
"""A hung rank's stack lines kept with its collectives in the failure report (its main thread,
innermost call first)."""
STOPPED = "(the process is stopped: SIGSTOP or a debugger; it cannot dump its stacks)"
HANG_PEERS_GRACE_S = 1.0
"""After its own dumps, how long an agent that found a hang waits before it stops its workers:
the other nodes' agents see the same stall within about a monitor interval and take theirs,
which a stop here would break (their collectives fail, their workers exit)."""

logger = logging.getLogger(__name__)


class Outcome(enum.Enum):
    """Why watching the workers of an attempt ended."""

    SUCCEEDED = "succeeded"
    """Every local worker exited 0 (or crashed in interpreter shutdown after finishing)."""
    FAILED = "failed"
    """A worker exited with an error or a signal."""
    HUNG = "hung"
    """A worker hung: past its phase's --hang-timeout (`dlrover.agent.hang_watch`)."""
    STOP = "stop"
    """The master ended the job."""
    REREGISTER = "reregister"
    """The master took this node for lost (or restarted without it)."""
    MEMBERSHIP = "membership"
    """Nodes wait to join, or a newer round formed: the world re-forms (no restart used)."""
    MASTER_LOST = "master_lost"
    """The master answered no heartbeat for --master-lost-timeout: the node stops."""
    JOINER_READY = "joiner_ready"
    """A replacement of a failed local rank is ready: the world grows back to take it in."""
    PARKED = "parked"
    """A worker that recovers in-process left its step by itself (its collective failed) and
    no failure in the job explains it: the world re-forms, and it counts as a failure."""


def describe_exit(e: WorkerExit) -> str:
    """ "exit code N" or "killed by SIGNAME"."""
    if e.returncode < 0:
        try:
            return f"killed by {signal.Signals(-e.returncode).name}"
        except ValueError:
            return f"killed by signal {-e.returncode}"
    return f"exit code {e.returncode}"


@dataclass
class MonitorSignals:
    """What the agent's other threads tell the monitor, and what it asks of them."""

    stop_requested: threading.Event
    reregister_requested: threading.Event
    world_must_reform: Callable[[], bool]
    """Asked every membership_check_interval_s; answered from the membership watch (no RPC)."""
    master_lost: threading.Event = field(default_factory=threading.Event)
    every_second: Callable[[], None] = lambda: None
    """The agent's own periodic work (starting the zygote)."""
    parked_unasked: Callable[[], bool] = lambda: False
    """Whether a worker that recovers in-process parked without being asked."""
    joiner_ready: Callable[[], bool] = lambda: False
    """Whether a replacement waiting to join said it is ready."""
    witness: Callable[[str, dict[int, dict[str, Any]]], None] = lambda why, collectives: None
    """Workers of this node wait in a collective for another node's rank past their timeout:
    why, and their collectives (global rank -> summary), for the master to name the laggard."""


class WorkerMonitor:
    """Watches one started group; `poll()` is one pass, `wait()` loops until an outcome.

    Keeps the node's newest step (`step`) from the workers' step files and, on a hang, the
    global ranks that hung (`hung`).
    """

    def __init__(
        self,
        group: WorkerGroup,
        plan: LaunchPlan,
        config: AgentConfig,
        signals: MonitorSignals,
        step: int = -1,
        history: PhaseHistory | None = None,
    ) -> None:
        self._group = group
        self._plan = plan
        self._config = config
        self._signals = signals
        self._done: dict[int, WorkerExit] = {}
        started = time.time()
        self._progress = ProgressWatch(config.nproc_per_node, started)
        self._hangs = HangWatch(
            config.hang,
            PhaseHistory() if history is None else history,
            config.nproc_per_node,
            started,
        )
        self._step_times = StepTimes()
        self._exit_watch = ExitWatch(config.exit_hang_timeout_s)
        self._ended_at_exit: set[int] = set()
        """Local ranks this monitor ended as hung at exit."""
        self._next_progress_check = 0.0
        self._next_membership_check = 0.0
        self.step = step
        self.attempt_step = -1
        """The highest step these workers reported (-1: none yet); below `step` while they
        re-do steps after a restart from a checkpoint."""
        self.attempt_step_at = 0.0
        """Wall time of the report of `attempt_step`."""
        self.attempt_first: tuple[int, float] | None = None
        """The first (step, wall time) seen of these workers."""
        self.hung: list[int] = []
        self.hang_reasons: list[str] = []
        """Why each of `hung` was found hung (one line each)."""
        self.collectives: dict[int, dict[str, Any]] = {}
        """Global rank -> its collectives' summary and stack, of the workers found hung."""

    def wait(self) -> Outcome:
        """Block until the group succeeds, a worker fails or hangs, membership changes, or
        the master stops or forgets this node."""
        while True:
            outcome = self.poll(self._config.monitor_interval_s)
            if outcome is not None:
                return outcome

    def poll(self, timeout: float) -> Outcome | None:
        """Wait up to `timeout` for a worker exit, then run the due checks once."""
        try:
            ex = self._group.exits.get(timeout=timeout)
        except queue.Empty:
            ex = None
        if ex is not None:
            return self._on_exit(ex)
        if self._signals.stop_requested.is_set():
            return Outcome.STOP
        if self._signals.reregister_requested.is_set():
            return Outcome.REREGISTER
        if self._signals.master_lost.is_set():
            return Outcome.MASTER_LOST
        if self._signals.parked_unasked():
            return Outcome.PARKED
        if self._signals.joiner_ready():
            return Outcome.JOINER_READY
        now = time.monotonic()
        if now >= self._next_progress_check:
            self._next_progress_check = now + 1.0
            if self.check_progress():
                return Outcome.HUNG
            self.end_workers_hung_at_exit()
            self._signals.every_second()
        if now < self._next_membership_check:
            return None
        # Worker exits are seen at once from the queue; the membership flag is set by the watch
        # thread, which the master answers the moment the world must re-form.
        self._next_membership_check = now + self._config.membership_check_interval_s
        return Outcome.MEMBERSHIP if self._signals.world_must_reform() else None

    def _on_exit(self, ex: WorkerExit) -> Outcome | None:
        group = self._group
        if group.pids.get(ex.local_rank) != ex.pid:
            return None  # a worker replaced in-process since: its exit was judged then
        self._done[ex.local_rank] = ex
        group.returncodes[ex.local_rank] = ex.returncode
        result = read_script_result(self._plan.files[ex.local_rank].done_file)
        if result is not None and ex.returncode != result and (ex.returncode < 0 or result == 0):
            logger.warning(
                "worker rank %d %s during interpreter shutdown after its script returned %d; "
                "counted as %s",
                ex.rank,
                "was ended" if ex.local_rank in self._ended_at_exit else describe_exit(ex),
                result,
                "succeeded" if result == 0 else f"exit code {result}",
            )
            group.returncodes[ex.local_rank] = result
            ex.returncode = result
        if ex.returncode != 0:
            logger.error("worker rank %d (pid %d) %s", ex.rank, ex.pid, describe_exit(ex))
            return Outcome.FAILED
        if all(lr in self._done for lr in self._plan.active):
            return Outcome.SUCCEEDED  # (a replacement still joining is not part of the round)
        return None

    @property
    def breakdown(self) -> StepBreakdown:
        """Seconds per step of the slowest worker lately, and its data-wait and checkpoint parts."""
        return self._step_times.breakdown

    @property
    def step_time_s(self) -> float:
        """The node's busy seconds per step lately (0.0 before a window was measured)."""
        return self._step_times.step_time_s

    def check_progress(self) -> bool:
        """Update the node's step and the workers' progress; True when a worker hangs
        (--hang-timeout, `dlrover.agent.hang_watch`). Workers without progress for
        --hang-warning-timeout get a warning with their stacks, once per stall, and keep
        running."""
        cfg = self._config
        now = time.time()
        pids = self._group.pids
        watch_cpu = cfg.hang_warning_timeout_s > 0
        # A rank whose script returned reports no more steps: a slow interpreter exit (a
        # throttled rank's teardown) is not a hang; the exit-hang watch judges it.
        done = set(self._done) | self._returned()
        for local_rank, files in enumerate(self._plan.files):
            record = read_step_file(files.step_file)
            if record is not None:
                self.step = max(self.step, record.step)
                if record.step > self.attempt_step:
                    self.attempt_step, self.attempt_step_at = record.step, record.at
                if self.attempt_first is None:
                    if record.first_step >= 0:
                        self.attempt_first = (record.first_step, record.first_at)
                    else:
                        self.attempt_first = (record.step, record.at)
                self._step_times.observe(local_rank, record, now)
            pid = pids.get(local_rank)
            cpu = cpu_seconds(pid) if watch_cpu and pid and local_rank not in done else None
            self._progress.observe(local_rank, record, cpu, now)
            self._hangs.observe(local_rank, record, read_sections(files.step_file), now)
        hangs = self._check_hangs(now, done)
        if hangs:
            self._on_hang(hangs, done)
            return True
        witnesses = self._hangs.witnesses(time.time(), done, self._whole_world_here())
        if witnesses:
            self._on_witnesses(witnesses)
        stalls = self._progress.new_stalls(cfg.hang_warning_timeout_s, now, done)
        if stalls:
            self._warn_stalls(stalls)
        return False

    def _check_hangs(self, now: float, done: set[int]) -> list[Hang]:
        """Workers hung now: past a fixed timeout, or past a learned one with a stack that
        stopped changing (sampled here while their phase is old)."""
        due = self._hangs.due(now, done)
        fixed = [
            Hang(
                d.local_rank,
                d.phase,
                f"{d.age_s:.0f}s in {d.phase} (--hang-timeout {d.timeout_s:g}s)",
            )  # fmt: skip
            for d in due
            if d.fixed
        ]
        if fixed:
            return fixed
        to_sample = [d.local_rank for d in due]
        if to_sample:
            stacks = self._stacks(to_sample)
            for local_rank, (pid, dump) in stacks.items():
                cpu = cpu_seconds(pid)
                self._hangs.sample(local_rank, _main_stack(dump), cpu, time.time())
        return self._hangs.hung(time.time(), done, whole_world_here=self._whole_world_here())

    def _whole_world_here(self) -> bool:
        """Whether every rank of the job is a worker of this node."""
        launches = self._plan.launches
        world = int(launches[0].env.get("WORLD_SIZE", len(launches))) if launches else 0
        return world == len(launches)

    def _on_hang(self, hangs: list[Hang], done: set[int]) -> None:
        """Log the hung workers with every running local worker's stacks, and keep their
        collectives (the laggard's name) for the failure report."""
        offset = self._plan.rank_offset
        running = [lr for lr in range(len(self._plan.files)) if lr not in done]
        stacks = self._stacks(running)
        logger.error(
            "hang: %s%s; the stacks of this node's running ranks:\n%s",
            "; ".join(f"rank {offset + h.local_rank}: {h.reason}" for h in hangs),
            f" (last step {self.step})" if self.step >= 0 else "",
            _stacks_text(stacks, offset),
        )
        self.hung = [self._plan.launches[h.local_rank].rank for h in hangs]
        self.hang_reasons = [f"rank {offset + h.local_rank}: {h.reason}" for h in hangs]
        self._record_collectives(running, stacks)

    def _on_witnesses(self, witnesses: list[Hang]) -> None:
        """Tell the master what this node's ranks wait in (their collectives and stacks), so
        that it names the rank of another node the job waits for; they keep waiting."""
        local = [w.local_rank for w in witnesses]
        offset = self._plan.rank_offset
        why = "; ".join(f"rank {offset + w.local_rank}: {w.reason}" for w in witnesses)
        stacks = self._stacks(local)
        logger.warning(
            "%s; telling the master what they wait in. Their stacks:\n%s",
            why,
            _stacks_text(stacks, offset),
        )
        launches, files = self._plan.launches, self._plan.files
        paths = {launches[lr].rank: files[lr].collectives_file for lr in local}
        summaries = ask_dump({r: p for r, p in paths.items() if p})
        for lr in local:
            rank = launches[lr].rank
            if rank in summaries and lr in stacks:
                summaries[rank]["stack"] = _main_stack(stacks[lr][1])
        self._signals.witness(why, summaries)

    def _returned(self) -> set[int]:
        """Running local ranks whose script has returned (their done file)."""
        return {
            local_rank
            for local_rank, files in enumerate(self._plan.files)
            if local_rank not in self._done and read_script_result(files.done_file) is not None
        }

    def end_workers_hung_at_exit(self) -> list[int]:
        """End the workers hung at exit (see `ExitWatch`), after logging their stacks; each then
        counts as what its script returned (its done file), or as failed when the script never
        returned. Returns their local ranks."""
        if self._config.exit_hang_timeout_s <= 0 or not self._done:
            ended = {}
        else:
            ended = self._ended_work_at()
        now = time.time()
        pids = self._group.pids
        for local_rank in ended:
            self._exit_watch.observe(local_rank, cpu_seconds(pids[local_rank]), now)
        hung = [lr for lr in self._exit_watch.hung(ended, now) if lr not in self._ended_at_exit]
        if not hung:
            return []
        offset = self._plan.rank_offset
        logger.error(
            "rank(s) %s did not exit %.0fs after %s (no step, under 1%% of a core); ending them "
            "(--exit-hang-timeout). Their stacks:\n%s",
            ", ".join(str(offset + lr) for lr in hung),
            self._config.exit_hang_timeout_s,
            "their script returned or the other ranks of this node exited successfully",
            self._stacks_text(hung),
        )
        self._ended_at_exit.update(hung)
        self._group.kill_ranks(hung)
        return hung

    def _ended_work_at(self) -> dict[int, float]:
        """Running local ranks that ended their work -> since when (wall time): their script
        returned (done file), or every other local rank exited successfully."""
        done = self._done
        others_succeeded = all(ex.returncode == 0 for ex in done.values())
        last_exit = max((ex.at for ex in done.values()), default=0.0)
        ended: dict[int, float] = {}
        for local_rank, files in enumerate(self._plan.files):
            if local_rank in done:
                continue
            since = None
            if read_script_result(files.done_file) is not None:
                since = _mtime(files.done_file)
            elif others_succeeded and len(done) == self._config.nproc_per_node - 1:
                since = last_exit
            if since is not None:
                ended[local_rank] = max(since, self._progress.progress_at(local_rank))
        return ended

    def _warn_stalls(self, stalls: list[Stall]) -> None:
        offset = self._plan.rank_offset
        ranks = ", ".join(str(offset + stall.local_rank) for stall in stalls)
        logger.warning(
            "no progress on rank(s) %s for %.0fs: %s. The job goes on; pass --hang-timeout S to "
            "restart workers that report no step for S seconds. Their Python stacks:\n%s",
            ranks,
            self._config.hang_warning_timeout_s,
            "; ".join(stall.describe(offset) for stall in stalls),
            self._stacks_text([stall.local_rank for stall in stalls]),
        )

    def _stacks(self, local_ranks: list[int]) -> dict[int, tuple[int, str]]:
        """Local rank -> (pid, every thread's Python stack) of these workers (asked by signal,
        read from their files)."""
        pids = self._group.pids
        # A stopped process cannot answer: no wait for its dump.
        stopped = {lr for lr in local_ranks if lr in pids and is_stopped(pids[lr])}
        targets = {
            lr: (pids[lr], self._plan.files[lr].stack_file)
            for lr in local_ranks
            if lr in pids and lr not in stopped
        }
        dumps = collect_stacks(targets)
        out = {lr: (targets[lr][0], dumps[lr]) for lr in dumps}
        out.update({lr: (pids[lr], STOPPED) for lr in stopped})
        return out

    def _stacks_text(self, local_ranks: list[int]) -> str:
        """Every thread's Python stack of these workers, one section per rank."""
        return _stacks_text(self._stacks(local_ranks), self._plan.rank_offset)

    def _record_collectives(self, stale: list[int], stacks: dict[int, tuple[int, str]]) -> None:
        """The hung workers' collectives (`dlrover.agent.collectives`), each with its stack's
        tail, for the failure report: global rank -> summary. Then a moment for the other
        nodes' agents, which see the same stall within about a monitor interval, to take
        theirs before this one's stop breaks their collectives."""
        files = self._plan.files
        launches = self._plan.launches
        paths = {
            launches[lr].rank: files[lr].collectives_file
            for lr in stale
            if files[lr].collectives_file
        }
        summaries = ask_dump(paths) if paths else {}
        for lr in stale:
            rank = launches[lr].rank
            if rank in summaries and lr in stacks:
                summaries[rank]["stack"] = _main_stack(stacks[lr][1])
        self.collectives = summaries
        for line in laggards(summaries):
            logger.error("hang: %s", line)
        if paths:
            time.sleep(HANG_PEERS_GRACE_S)

    def forget(self, local_rank: int) -> None:
        """A worker of ``local_rank`` was replaced: what its predecessor did no longer counts."""
        self._done.pop(local_rank, None)

    def collect_failures(self) -> dict[int, int]:
        """Global rank -> return code of the workers that failed so far; the others run on."""
        group = self._group
        launches = self._plan.launches
        exits = {launches[lr].rank: rc for lr, rc in group.returncodes.items() if rc != 0}
        pids = group.pids
        while True:
            try:
                ex = group.exits.get_nowait()
            except queue.Empty:
                return exits
            if ex.returncode != 0 and pids.get(ex.local_rank) == ex.pid:
                group.returncodes[ex.local_rank] = ex.returncode
                exits.setdefault(ex.rank, ex.returncode)

    def stop_and_collect_failures(self) -> dict[int, int]:
        """Stop the group and return global rank -> return code of the workers that failed.

        No fixed wait: exits already queued are taken, the group is stopped at once, and of the
        exits that follow only those not caused by our own signals count (the root cause is
        picked by error-file time later). Hung workers count as killed by us.
        """
        group = self._group
        launches = self._plan.launches
        exits = {launches[lr].rank: rc for lr, rc in group.returncodes.items() if rc != 0}

        def drain(ours: tuple[int, ...]) -> None:
            while True:
                try:
                    ex = group.exits.get_nowait()
                except queue.Empty:
                    return
                current = group.pids.get(ex.local_rank) == ex.pid  # not one replaced since
                if ex.returncode != 0 and ex.returncode not in ours and current:
                    exits.setdefault(ex.rank, ex.returncode)

        drain(())
        group.stop(self._config.stop_grace_s)
        drain((-signal.SIGTERM, -signal.SIGKILL))
        for rank in self.hung:
            exits.setdefault(rank, -signal.SIGKILL)
        return exits


def _main_stack(dump: str) -> str:
    """The thread a faulthandler dump calls current (the main one, where the script hangs),
    innermost call first, at most STACK_LINES lines."""
    at = dump.find("Current thread")
    lines = (dump[at:] if at >= 0 else dump).splitlines()
    return "\n".join(lines[:STACK_LINES])


def _stacks_text(stacks: dict[int, tuple[int, str]], offset: int) -> str:
    return "\n".join(
        f"--- rank {offset + lr} (pid {pid}) ---\n{text}"
        for lr, (pid, text) in sorted(stacks.items())
    )


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return time.time()
