"""Runtime straggler scores: each node's step time against the fastest node's and its own best.

Agents send their node's busy seconds per training step with each heartbeat (the slowest local
worker's own work per step, without waiting for other ranks: `dlrover.trainer.report_step`'s
``busy_s``, or its CPU seconds). Every ``report_s`` seconds the master scores each running
member: ``relative`` = the fastest member's step time / this node's (1.0 for the fastest),
``individual`` = this node's best step time so far / its current one (1.0: as fast as it ever
was). A node whose relative score stays below ``threshold`` for ``reports`` reports in a row is
a straggler: logged, shown in `dlrover status`, and with `exclude_straggler` replaced through
the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

DEFAULT_REPORT_S = 60.0
DEFAULT_THRESHOLD = 0.75
DEFAULT_REPORTS = 3


@dataclass(frozen=True)
class Score:
    """One node's scores in one report."""

    node_id: str
    step_time_s: float
    relative: float
    individual: float
    low_reports: int
    """Reports in a row with ``relative`` below the threshold, this one included."""

    def describe(self) -> str:
        """``node 0.33 (own 0.98, 0.61s/step)``."""
        return (
            f"{self.node_id} {self.relative:.2f} (own {self.individual:.2f}, "
            f"{self.step_time_s:.3f}s/step)"
        )


class StragglerWatch:
    """Scores nodes from their latest step times; not thread-safe (the JobMaster locks)."""

    def __init__(
        self,
        clock: Callable[[], float],
        report_s: float = DEFAULT_REPORT_S,
        threshold: float = DEFAULT_THRESHOLD,
        reports: int = DEFAULT_REPORTS,
    ) -> None:
        self._clock = clock
        self.report_s = report_s
        self.threshold = threshold
        self.reports = reports
        self._latest: dict[str, float] = {}
        self._best: dict[str, float] = {}
        self._low: dict[str, int] = {}
        self._next = clock() + report_s
        self.scores: dict[str, Score] = {}
        """The last report's scores by node."""

    def observe(self, node_id: str, step_time_s: float) -> None:
        """A node's latest busy seconds per step (0 or less: not measured, ignored)."""
        if step_time_s > 0:
            self._latest[node_id] = step_time_s
            self._best[node_id] = min(step_time_s, self._best.get(node_id, step_time_s))

    def forget(self, node_id: str) -> None:
        """The node left the job (a replacement starts with no history)."""
        for table in (self._latest, self._best, self._low, self.scores):
            table.pop(node_id, None)

    def due(self) -> bool:
        """Whether a report is due now (and, if so, schedule the next one)."""
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + self.report_s
        return True

    def report(self, members: Iterable[str]) -> tuple[list[Score], list[str]]:
        """Score the ``members`` that have a step time; returns the scores and the nodes that
        just became stragglers (their ``reports``-th low report in a row)."""
        times = {n: self._latest[n] for n in members if n in self._latest}
        if not times:
            return [], []
        fastest = min(times.values())
        scores: list[Score] = []
        new: list[str] = []
        for node, t in sorted(times.items()):
            relative = fastest / t
            low = self._low.get(node, 0) + 1 if relative < self.threshold else 0
            self._low[node] = low
            score = Score(node, t, relative, self._best[node] / t, low)
            scores.append(score)
            if low == self.reports:
                new.append(node)
        self.scores = {s.node_id: s for s in scores}
        return scores, new
