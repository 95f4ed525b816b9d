"""Live goodput: how much of the job's elapsed time went into steps it keeps.

The master sees its rendezvous rounds and, with each heartbeat (about every 2 s), a node's
current workers' latest step and the first step they reported, each with the time it was
reported. Every span between two such step times is put in one bucket:

- ``productive``: the step rose past the highest step the job ever reached (new work);
- ``rollback``: the step rose, but only re-doing steps done before a failure (from the last
  checkpoint back up to where the job had been); a span that does both is split by steps;
- ``startup``: from the master's start to the first step of the first round;
- ``restart``, ``in_process``, ``relaunch``: from the last step seen in a round until the first
  step of the next one (the failure, the re-form, the workers' start and their checkpoint
  load), by how the failures before that round were recovered (the costliest of them): workers
  restarted in place, survivors kept in their processes, or a node relaunched; a re-form with
  no failure (a node joining) is ``restart``;
- ``idle``: after the last step, until the job ended (exit barrier, teardown).

goodput = productive / elapsed since the master started. A span's steps are spread evenly over
it, so a span that re-does some steps and goes past is split by steps; live while it runs. Pure: the
caller passes times; tests drive it with a fake clock.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from dlrover.api.master import HeartbeatReport

_CLOCK_SLACK_S = 0.5
"""Step times come from the agents' clocks as ages; this much disagreement is tolerated."""

REASONS = ("startup", "restart", "in_process", "relaunch", "rollback", "idle")
"""The badput buckets (see the module)."""
_RECOVERY_KINDS = {"recover_in_process": "in_process", "relaunch_node": "relaunch"}
"""A failure's action -> its recovery's bucket (any other action: ``restart``)."""
_COST = ("in_process", "restart", "relaunch")
"""Recovery buckets, cheapest first: a round after several failures counts as the costliest."""
HISTORY_EVERY_S = 5.0
HISTORY_POINTS = 720
"""The goodput chart keeps a point every 5 s for the last hour."""


@dataclass(frozen=True)
class StepSample:
    """What a heartbeat says of a node's current workers: their latest step and the first one
    the agent saw, each with its age (seconds before the heartbeat): exact step times, whatever
    the heartbeat interval."""

    step: int
    age_s: float
    first_step: int
    first_age_s: float

    @classmethod
    def of(cls, report: HeartbeatReport) -> StepSample | None:
        """The sample in ``report``, or None when its workers reported no step yet."""
        if report.attempt_step < 0 or report.attempt_first_step < 0:
            return None
        return cls(
            report.attempt_step,
            report.attempt_step_age_s,
            report.attempt_first_step,
            report.attempt_first_age_s,
        )


@dataclass(frozen=True)
class GoodputSnapshot:
    """What `GoodputTracker.snapshot` reports."""

    elapsed_s: float
    productive_s: float
    badput_s: dict[str, float]
    ratio: float
    steps: int
    """The highest step the job reached."""
    step_s: float
    """Seconds per step lately (0: not measured yet)."""
    recoveries_s: tuple[float, ...]
    """Each restart: from the last progress before it until the job went past that step again."""


class GoodputTracker:
    """Accumulates productive time and badput from step and round observations."""

    def __init__(
        self, now: float, on_recovered: Callable[[int, float], None] | None = None
    ) -> None:
        """``on_recovered(round, seconds)``: called (outside the lock) when the job goes past
        its last step before ``round``, ``seconds`` after its last progress then."""
        self._lock = threading.Lock()
        self._on_recovered = on_recovered
        self._recovered: list[tuple[int, float]] = []
        self._round_at = now
        self._start = now
        self._last_t = now
        self._round = 0
        self._resumed = False
        """The current round was formed before this master started (a restarted master): its
        workers' first steps predate the round's time here and still count."""
        self._step = -1
        """The job's step in the current round (-1: none seen in it yet)."""
        self._max = -1
        """The highest step the job ever reached."""
        self._productive = 0.0
        self._badput = dict.fromkeys(REASONS, 0.0)
        self._ended_at: float | None = None
        self._stalled_at: float | None = None
        """When the last round's progress stopped (a restart's start), until progress resumes
        past the old highest step."""
        self._recoveries: list[float] = []
        self._recovery_of: dict[int, float] = {}
        """Round -> seconds from the last progress before it until the job passed that step."""
        self._kind = ""
        """How the failures since the last round were recovered ("": no failure)."""
        self._round_kind = "restart"
        """The bucket of the current round's restart span."""
        self._step_s = 0.0
        self._history: deque[tuple[float, float]] = deque(maxlen=HISTORY_POINTS)
        self._next_sample = now

    def recovery_of(self, round: int) -> float:
        """Seconds from the job's last progress before ``round`` formed until it went past that
        step again (0.0: not yet, or ``round`` followed no stall)."""
        with self._lock:
            return self._recovery_of.get(round, 0.0)

    def on_failure(self, action: str) -> None:
        """A failure was recovered by ``action`` (a `FailureAction` value): the next round's
        restart span goes to its bucket (the costliest of the failures before that round)."""
        kind = _RECOVERY_KINDS.get(action, "restart")
        with self._lock:
            if not self._kind or _COST.index(kind) > _COST.index(self._kind):
                self._kind = kind

    def on_round(self, now: float, round: int, resumed: bool = False) -> None:
        """A rendezvous round formed: the span since the last step was a start-up or restart.

        ``resumed``: the round formed under a master before this one, which restarted while its
        workers kept training; their heartbeats count although their first step came before
        ``now`` (only the part of their progress after ``now`` is this tracker's).
        """
        with self._lock:
            if round <= self._round or self._ended_at is not None:
                return
            if self._round > 0 and self._stalled_at is None:
                self._stalled_at = self._last_t
            self._round = round
            self._round_at = now
            self._resumed = resumed
            self._round_kind, self._kind = self._kind or "restart", ""
            self._step = -1

    def on_step(self, now: float, round: int, step: int) -> None:
        """A node of ``round`` reported that its workers reached ``step`` just now."""
        self.on_progress(now, round, StepSample(step, 0.0, step, 0.0))

    def on_progress(self, now: float, round: int, sample: StepSample) -> None:
        """A heartbeat of a member of ``round`` at ``now`` with its workers' steps."""
        first_t = now - sample.first_age_s
        latest_t = now - sample.age_s
        with self._lock:
            if self._ended_at is not None or round != self._round:
                return
            if first_t < self._round_at - _CLOCK_SLACK_S:
                if not self._resumed:
                    return  # workers of the round before (a heartbeat sent before the restart)
                if self._step < 0:
                    self._resume_from(sample, first_t, latest_t)
            if self._step < 0:  # the round's first report: until its first step, it started
                span = max(0.0, first_t - self._last_t)
                self._badput["startup" if self._max < 0 else self._round_kind] += span
                self._last_t = max(self._last_t, first_t)
                self._reach(sample.first_step, first_t)
            self._advance(latest_t, sample.step)
            recovered, self._recovered = self._recovered, []
        if self._on_recovered is not None:
            for rnd, seconds in recovered:
                self._on_recovered(rnd, seconds)

    def _resume_from(self, sample: StepSample, first_t: float, latest_t: float) -> None:
        """The first report of a resumed round whose workers trained before this tracker
        started: count from the step they were at when the round was taken over (its steps are
        spread evenly over the sample's span), as if that were the round's first step."""
        start = self._round_at
        steps = sample.step - sample.first_step
        if latest_t > start and latest_t > first_t:
            done = int(steps * (start - first_t) / (latest_t - first_t))
        else:
            done = steps  # no step since the round was taken over
        self._last_t = max(self._last_t, start)
        self._reach(sample.first_step + max(0, min(steps, done)), start)

    def _advance(self, t: float, step: int) -> None:
        if step <= self._step:
            return
        span = max(0.0, t - self._last_t)
        new = max(0, step - max(self._step, self._max))
        share = new / (step - self._step)
        self._productive += span * share
        self._badput["rollback"] += span * (1 - share)
        if new:
            self._step_s = span / (step - self._step)
        self._reach(step, t)
        self._last_t = max(self._last_t, t)

    def _reach(self, step: int, t: float) -> None:
        if step > self._max and self._stalled_at is not None:
            self._recoveries.append(max(0.0, t - self._stalled_at))
            self._recovery_of[self._round] = self._recoveries[-1]
            self._recovered.append((self._round, self._recoveries[-1]))
            self._stalled_at = None
        self._step = max(self._step, step)
        self._max = max(self._max, step)

    def on_end(self, now: float) -> None:
        """The job ended: the span since the last step was idle (or a start-up that never
        trained)."""
        with self._lock:
            if self._ended_at is not None:
                return
            span = max(0.0, now - self._last_t)
            self._badput["startup" if self._max < 0 else "idle"] += span
            self._ended_at = self._last_t = now

    def snapshot(self, now: float) -> GoodputSnapshot:
        """Totals until ``now`` (the open span since the last step counts in elapsed only)."""
        with self._lock:
            end = self._ended_at if self._ended_at is not None else now
            elapsed = max(0.0, end - self._start)
            return GoodputSnapshot(
                elapsed_s=elapsed,
                productive_s=self._productive,
                badput_s=dict(self._badput),
                ratio=self._productive / elapsed if elapsed > 0 else 0.0,
                steps=max(self._max, 0),
                step_s=self._step_s,
                recoveries_s=tuple(self._recoveries),
            )

    def sample(self, now: float, wall: float) -> None:
        """Keep a chart point (wall time, goodput) every HISTORY_EVERY_S."""
        if now < self._next_sample:
            return
        self._next_sample = now + HISTORY_EVERY_S
        ratio = self.snapshot(now).ratio
        with self._lock:
            self._history.append((wall, ratio))

    def history(self) -> list[tuple[float, float]]:
        """The chart's points, oldest first."""
        with self._lock:
            return list(self._history)
