"""What the master measures of a TensorFlow job's load: the job's step and sample rates."""

from __future__ import annotations

import collections
import dataclasses

from dlrover.coordination import TfProgress

DEFAULT_RATE_WINDOW_S = 10.0
"""The span the rates are measured over (the chief reports each time its batches finish)."""


@dataclasses.dataclass(frozen=True)
class Rates:
    """The job's throughput lately (0.0 until two reports span some time)."""

    steps_per_s: float = 0.0
    samples_per_s: float = 0.0
    span_s: float = 0.0
    """The time the rates were measured over."""
    steps: int = 0
    """Steps (batches) finished by the newest report."""


class Throughput:
    """The chief's progress reports -> the job's step and sample rates over the last
    ``window_s`` seconds of reports. A report whose count went back (the chief restored an
    older checkpoint) starts the measurement over: counts before it do not compare."""

    def __init__(self, window_s: float = DEFAULT_RATE_WINDOW_S) -> None:
        self._window_s = window_s
        self._points: collections.deque[TfProgress] = collections.deque()

    def add(self, progress: TfProgress) -> None:
        """Take one report (the same report again changes nothing)."""
        last = self._points[-1] if self._points else None
        if last is not None and progress.at <= last.at:
            return
        if last is not None and progress.samples < last.samples:
            self._points.clear()
        self._points.append(progress)
        # Keep one point at or before the window's start, so the span covers the window.
        while len(self._points) > 2 and self._points[1].at <= progress.at - self._window_s:
            self._points.popleft()

    @property
    def latest(self) -> TfProgress | None:
        """The newest report taken (None before one)."""
        return self._points[-1] if self._points else None

    def rates(self) -> Rates:
        """Steps and samples per second between the oldest and newest reports kept."""
        if len(self._points) < 2:
            return Rates(steps=self._points[-1].batches if self._points else 0)
        first, last = self._points[0], self._points[-1]
        span = last.at - first.at
        return Rates(
            (last.batches - first.batches) / span,
            (last.samples - first.samples) / span,
            span,
            last.batches,
        )
