"""The job over time, for the dashboard's charts: goodput and badput, and each node's step time,
throughput, CPU and memory, with the timeline's events as markers.

The master samples every ``every_s`` (its tick). The whole job is kept at a falling resolution:
when ``max_points`` samples are held, every other one is dropped and the interval doubles, so a
day-long job keeps its start as well as its last minutes in bounded memory (at most 720 samples
of `MAX_CHARTED_NODES` nodes, ~5 MB). `JobHistory.document` is what ``/api/history`` serves and what an
ended job leaves in ``history.json`` beside its final state.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from dlrover.master.goodput import REASONS
from dlrover.master.job import JobMaster

DEFAULT_EVERY_S = 2.0
"""Seconds between samples at the start (doubled each time ``max_points`` fill up)."""
DEFAULT_MAX_POINTS = 720
MAX_MARKERS = 1000
"""The newest timeline events kept as chart markers."""
MAX_CHARTED_NODES = 64
"""Nodes charted per sample, the lowest ranks first: a chart of more lines is unreadable, and
720 samples of 10,000 nodes would cost the master a gigabyte (`dlrover status`, the table and
/metrics have every node)."""
NODE_SERIES = ("step_s", "samples_per_s", "steps_per_s", "cpu_percent", "memory_mib")
"""What is charted per node: seconds per step, samples and steps per second, CPU %, MiB."""


@dataclass(frozen=True)
class _Sample:
    at: float
    """Wall time (unix seconds)."""
    elapsed_s: float
    productive_s: float
    badput_s: tuple[float, ...]
    """Cumulative, by `REASONS`."""
    ratio: float
    steps: int
    step_s: float
    nodes: dict[str, tuple[float, float, int, float, float]] = field(default_factory=dict)
    """node id -> (s/step, samples/s, step, CPU %, MiB) of the nodes alive then (-1: no step)."""


class JobHistory:
    """Samples of the job (see the module); thread-safe: the tick samples, the web reads."""

    def __init__(
        self,
        job: JobMaster,
        every_s: float = DEFAULT_EVERY_S,
        max_points: int = DEFAULT_MAX_POINTS,
    ) -> None:
        if max_points < 4:
            raise ValueError(f"max_points must be at least 4, not {max_points}")
        self._job = job
        self._every_s = every_s
        self._max_points = max_points
        self._samples: list[_Sample] = []
        self._markers: deque[tuple[float, str, str]] = deque(maxlen=MAX_MARKERS)
        self._seen_event: tuple[float, str, str] | None = None
        self._next = 0.0
        self._lock = threading.Lock()

    @property
    def every_s(self) -> float:
        """The interval between the samples kept now."""
        return self._every_s

    def maybe_sample(self, now: float) -> None:
        """Take a sample if the interval passed (``now``: the master's monotonic clock)."""
        if now < self._next:
            return
        self._next = now + self._every_s
        self.sample(now)

    def sample(self, now: float) -> None:
        """Take one sample of the job now, and the timeline's events since the last one."""
        job = self._job
        g = job.diagnostics.goodput.snapshot(now)
        alive = job.members.nodes.first_alive(MAX_CHARTED_NODES)
        nodes = {
            n.node_id: (n.breakdown[0], n.samples_per_s, n.step, n.cpu_percent, n.memory_bytes)
            for n in alive
        }
        for r in job.roles.role_nodes():  # a TensorFlow job's or embedding servers' nodes
            if r.state in ("pending", "running") and len(nodes) < MAX_CHARTED_NODES:
                nodes[r.node_id] = (0.0, 0.0, -1, r.cpu_percent, r.memory_bytes)
        sample = _Sample(
            at=time.time(),
            elapsed_s=g.elapsed_s,
            productive_s=g.productive_s,
            badput_s=tuple(g.badput_s.get(reason, 0.0) for reason in REASONS),
            ratio=g.ratio,
            steps=g.steps,
            step_s=g.step_s,
            nodes={k: (a, b, c, d, e / 2**20) for k, (a, b, c, d, e) in nodes.items()},
        )
        events = list(job.diagnostics.events)
        with self._lock:
            self._take_events(events)
            self._samples.append(sample)
            if len(self._samples) >= self._max_points:
                # Every other sample goes, the newest stays: the chart reaches its last point.
                self._samples = self._samples[-1::-2][::-1]
                self._every_s *= 2
                self._next = now + self._every_s

    def _take_events(self, events: list[tuple[float, str, str]]) -> None:
        start = 0
        if self._seen_event is not None:
            for i in range(len(events) - 1, -1, -1):
                if events[i] == self._seen_event:
                    start = i + 1
                    break
        self._markers.extend(events[start:])
        if events:
            self._seen_event = events[-1]

    def document(self) -> dict[str, Any]:
        """The charts' data, columns over one time axis (``null`` where a node was not alive):

        - ``t``: unix seconds of each sample;
        - ``goodput``: the job's goodput ratio so far at each sample;
        - ``shares``: per interval since the sample before, the part of the wall time that was
          ``productive`` and each badput reason's part (together about 1.0; the first is null);
        - ``nodes``: node id -> each of `NODE_SERIES` (steps per second: 1 / its s/step);
        - ``markers``: ``{at, kind, text}`` of the timeline's events (failures, rounds,
          checkpoints, scale plans, nodes lost), oldest first;
        - ``totals``: the goodput figures at the last sample (``elapsed_s``, ``productive_s``,
          ``badput_s`` by reason, ``ratio``, ``steps``, ``step_s``; {} before a sample);
        - ``every_s``: the interval between samples now.
        """
        with self._lock:
            samples = list(self._samples)
            markers = list(self._markers)
            every_s = self._every_s
        t = [s.at for s in samples]
        shares: dict[str, list[float | None]] = {"productive": []}
        shares.update({reason: [] for reason in REASONS})
        for before, s in zip([None, *samples], samples, strict=False):
            span = s.elapsed_s - before.elapsed_s if before is not None else 0.0
            if before is None or span <= 0:
                for column in shares.values():
                    column.append(None)
                continue
            parts = [max(0.0, s.productive_s - before.productive_s)] + [
                max(0.0, s.badput_s[k] - before.badput_s[k]) for k in range(len(REASONS))
            ]
            # Steps are credited when heartbeats tell of them, a little after they ran: an
            # interval can be given more than its span; its parts are then scaled to it.
            scale = max(span, sum(parts))
            for name, part in zip(shares, parts, strict=True):
                shares[name].append(part / scale)
        node_ids = sorted({node for s in samples for node in s.nodes})
        nodes: dict[str, dict[str, list[float | None]]] = {}
        for node in node_ids:
            series: dict[str, list[float | None]] = {name: [] for name in NODE_SERIES}
            for s in samples:
                value = s.nodes.get(node)
                if value is None:
                    for name in NODE_SERIES:
                        series[name].append(None)
                    continue
                step_s, samples_per_s, _, cpu, mib = value
                series["step_s"].append(step_s or None)
                series["samples_per_s"].append(samples_per_s or None)
                series["steps_per_s"].append(1.0 / step_s if step_s > 0 else None)
                series["cpu_percent"].append(cpu)
                series["memory_mib"].append(mib)
            nodes[node] = series
        return {
            "t": t,
            "goodput": [s.ratio for s in samples],
            "shares": shares,
            "nodes": nodes,
            "markers": [{"at": at, "kind": kind, "text": text} for at, kind, text in markers],
            "totals": _totals(samples[-1]) if samples else {},
            "every_s": every_s,
        }


def _totals(last: _Sample) -> dict[str, Any]:
    return {
        "elapsed_s": last.elapsed_s,
        "productive_s": last.productive_s,
        "badput_s": dict(zip(REASONS, last.badput_s, strict=True)),
        "ratio": last.ratio,
        "steps": last.steps,
        "step_s": last.step_s,
    }
