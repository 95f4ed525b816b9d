"""Which workers of a node make no progress: reported steps, or CPU use for scripts that never report."""

from __future__ import annotations

from dataclasses import dataclass, replace

from dlrover.trainer.progress import StepRecord

MIN_CPU_SHARE = 0.01
"""A worker that never reported a step counts as progressing while it uses at least this share of
one core (plus one clock tick) since its last progress: blocked in a collective it uses ~0."""

CPU_TICK_S = 0.01
"""Resolution of per-process CPU times on Linux (USER_HZ = 100)."""


@dataclass
class _Rank:
    step: int = -1
    """Latest step the worker reported; -1 while it has reported none."""
    record: StepRecord | None = None
    """The step file's latest record."""
    progress_at: float = 0.0
    """Wall time of the worker's latest progress (new step, or enough CPU used)."""
    cpu_mark_s: float = 0.0
    """The worker's CPU seconds at `progress_at`."""
    warned: bool = False
    """A warning was logged for the current stall (re-armed by progress)."""


@dataclass(frozen=True)
class Stall:
    """One worker without progress: what the warning says about it."""

    local_rank: int
    idle_s: float
    step: int
    """Its latest reported step, or -1 when it never reported one (judged by CPU use)."""

    def describe(self, rank_offset: int) -> str:
        """One line for the stall warning, naming the global rank (``rank_offset`` + local rank)."""
        how = (
            f"last step {self.step}"
            if self.step >= 0
            else "never reported a step and used under 1% of a core"
        )
        return f"rank {rank_offset + self.local_rank} ({how}, {self.idle_s:.0f}s without progress)"


class ProgressWatch:
    """Tracks the progress of one worker group; pure, fed by the agent with wall-clock samples.

    Progress is a new step in the worker's step file (`dlrover.trainer.report_step`), or, for a
    worker that has never reported a step, CPU use of at least MIN_CPU_SHARE of a core since its
    last progress (its process and its children: data-loader workers count). A worker that once
    reported a step is judged by steps alone, since a spinning collective also burns CPU.
    """

    def __init__(self, num_workers: int, started_at: float) -> None:
        self._ranks = [_Rank(progress_at=started_at) for _ in range(num_workers)]

    def observe(
        self, local_rank: int, step_record: StepRecord | None, cpu_s: float | None, now: float
    ) -> None:
        """Feed one sample: the worker's step file record and CPU seconds."""
        rank = self._ranks[local_rank]
        if step_record is not None and step_record != rank.record:
            rank.record = step_record
            rank.step = step_record[0]
            rank.progress_at = max(rank.progress_at, min(step_record[1], now))
            rank.warned = False
            if cpu_s is not None:
                rank.cpu_mark_s = cpu_s
        elif (
            rank.step < 0
            and cpu_s is not None
            and cpu_s - rank.cpu_mark_s >= MIN_CPU_SHARE * (now - rank.progress_at) + CPU_TICK_S
        ):
            rank.progress_at = now
            rank.cpu_mark_s = cpu_s
            rank.warned = False

    def new_stalls(self, timeout_s: float, now: float, finished: set[int]) -> list[Stall]:
        """Workers without progress for `timeout_s` not warned about yet (each stall once)."""
        if timeout_s <= 0:
            return []
        stalls = []
        for local_rank, rank in enumerate(self._ranks):
            idle = now - rank.progress_at
            if local_rank in finished or rank.warned or idle < timeout_s:
                continue
            rank.warned = True
            stalls.append(Stall(local_rank, idle, rank.step))
        return stalls

    def progress_at(self, local_rank: int) -> float:
        """Wall time of the latest progress of ``local_rank`` (a step, or CPU use)."""
        return self._ranks[local_rank].progress_at

    def last_step(self, local_rank: int) -> int:
        """The latest step ``local_rank`` reported, or -1 if it never reported one."""
        return self._ranks[local_rank].step


class ExitWatch:
    """Which workers hang at exit: their script has ended, or every other local worker exited
    successfully, yet the process stays, idle. Pure, fed by the agent with wall-clock samples.

    A candidate counts from when it ended its work (its done file, else the last successful exit
    of the others); any progress since (a new step, or CPU use of at least MIN_CPU_SHARE of a
    core) restarts its clock: a rank still writing a last checkpoint is not hung.
    """

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._cpu: dict[int, tuple[float, float]] = {}  # local rank -> (CPU s, wall time) mark

    def observe(self, local_rank: int, cpu_s: float | None, now: float) -> None:
        """Feed a candidate's CPU seconds (None: unknown); its idle clock starts at the first."""
        if cpu_s is None:
            return
        mark = self._cpu.get(local_rank)
        if mark is None or cpu_s - mark[0] >= MIN_CPU_SHARE * (now - mark[1]) + CPU_TICK_S:
            self._cpu[local_rank] = (cpu_s, now)

    def hung(self, ended_at: dict[int, float], now: float) -> list[int]:
        """Candidates (local rank -> when it ended its work or last reported a step, whichever
        is later) idle for the timeout since then."""
        if self._timeout_s <= 0:
            return []
        return [
            local_rank
            for local_rank, ended in sorted(ended_at.items())
            if local_rank in self._cpu
            and now - max(ended, self._cpu[local_rank][1]) >= self._timeout_s
        ]


@dataclass(frozen=True)
class StepBreakdown:
    """Seconds per step: wall time, and the parts spent waiting for data and checkpointing; and
    the node's samples per second (its workers' together, where their scripts report samples)."""

    wall_s: float = 0.0
    data_s: float = 0.0
    checkpoint_s: float = 0.0
    samples_per_s: float = 0.0


STEP_TIME_WINDOW_S = 10.0
"""How often the node's step time is measured again (a heartbeat carries the latest)."""
BREAKDOWN_WINDOW_S = 2.0
"""How often the node's step-time breakdown (wall, data, checkpoint) is measured again."""


class StepTimes:
    """The node's busy seconds per step, measured over windows of STEP_TIME_WINDOW_S from the
    workers' step files: the slowest local worker's growth of `StepRecord.busy_s` over the steps
    it did in the window (the master scores nodes against each other with it)."""

    def __init__(
        self, window_s: float = STEP_TIME_WINDOW_S, breakdown_window_s: float = BREAKDOWN_WINDOW_S
    ) -> None:
        self._window_s = window_s
        self._marks: dict[int, StepRecord] = {}
        self._latest: dict[int, StepRecord] = {}
        self._window_start: float | None = None
        self.step_time_s = 0.0
        """The last window's busy seconds per step (0.0 before one was measured)."""
        self.breakdown = StepBreakdown()
        """The last window's wall seconds per step of the slowest worker, and their parts."""
        self._breakdown_window_s = breakdown_window_s
        self._breakdown_marks: dict[int, StepRecord] = {}
        self._breakdown_start: float | None = None

    def _observe_breakdown(self, local_rank: int, record: StepRecord, now: float) -> None:
        # Its own, shorter window: a heartbeat's view of the step time, not a straggler score.
        self._breakdown_marks.setdefault(local_rank, record)
        if self._breakdown_start is None:
            self._breakdown_start = now
        if now - self._breakdown_start < self._breakdown_window_s:
            return
        pairs = [
            (latest, mark)
            for rank, latest in self._latest.items()
            if (mark := self._breakdown_marks.get(rank)) and latest.step > mark.step
        ]
        parts = [
            StepBreakdown(
                (latest.at - mark.at) / (n := latest.step - mark.step),
                (latest.data_s - mark.data_s) / n,
                (latest.checkpoint_s - mark.checkpoint_s) / n,
            )
            for latest, mark in pairs
        ]
        if parts:
            samples_per_s = sum(
                (latest.samples - mark.samples) / (latest.at - mark.at)
                for latest, mark in pairs
                if latest.at > mark.at and latest.samples >= mark.samples
            )
            slowest = max(parts, key=lambda b: b.wall_s)
            self.breakdown = replace(slowest, samples_per_s=samples_per_s)
        self._breakdown_marks = dict(self._latest)
        self._breakdown_start = now

    def observe(self, local_rank: int, record: StepRecord, now: float) -> None:
        """Feed a worker's latest record (any time; the window closes on the clock)."""
        self._latest[local_rank] = record
        self._marks.setdefault(local_rank, record)
        self._observe_breakdown(local_rank, record, now)
        if self._window_start is None:
            self._window_start = now
        if now - self._window_start < self._window_s:
            return
        rates = [
            (latest.busy_s - mark.busy_s) / (latest.step - mark.step)
            for rank, latest in self._latest.items()
            if (mark := self._marks[rank]) and latest.step > mark.step
        ]
        if rates:
            self.step_time_s = max(rates)
        self._marks = dict(self._latest)
        self._window_start = now
