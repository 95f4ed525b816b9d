"""The resource optimiser's policies: pure functions of observed state, returning a `ScalePlan`.

The master feeds it what it sees (each node's CPU cores used and peak memory from heartbeats,
the job's throughput at each node count from step reports, what the engine can still launch)
and a controller applies the plan through the engine. Nothing here reads a clock of its own or
does I/O, so every policy is tested on recorded traces with a fake clock.

Policies:

- **sizing**: a job submitted without resources is measured for ``sizing_window_s``; then each
  node gets memory = peak x ``margin`` and CPU = cores used x ``margin`` (rounded up to whole
  MiB / half cores), and the nodes are relaunched at that size. Memory creeping towards the
  size (peak above ``resize_at`` of it) resizes again the same way.
- **horizontal** (all-reduce jobs, within ``--nnodes MIN:MAX``): add a node while the last
  added node raised throughput by at least ``speedup_threshold`` (20%: the first step from MIN is
  always tried) and the engine has room for one more; remove the last node when it adds less
  than half of that, after ``scale_in_votes`` plans in a row said so.
- ``cooldown_s`` (5 min) between two actions; every plan carries its reason.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dlrover.engines.base import Capacity, Resources


class ScaleAction(str, enum.Enum):
    """What a plan asks the controller to do."""

    NONE = "none"
    RESIZE = "resize"
    """Relaunch every node with `ScalePlan.resources`."""
    SCALE_OUT = "scale_out"
    SCALE_IN = "scale_in"


@dataclass(frozen=True)
class ScalePlan:
    """The optimiser's decision: an action, the node count and size it leads to, and why."""

    action: ScaleAction
    nodes: int
    resources: Resources | None = None
    reason: str = ""


@dataclass(frozen=True)
class NodeUsage:
    """What one node used lately (heartbeats)."""

    node_id: str
    cpu_cores: float
    memory_peak_mib: int


@dataclass(frozen=True)
class OptimizerConfig:
    """The policies' knobs (defaults as documented in the module)."""

    min_nodes: int
    max_nodes: int
    margin: float = 1.3
    sizing_window_s: float = 60.0
    resize_at: float = 0.9
    speedup_threshold: float = 0.2
    scale_in_votes: int = 2
    cooldown_s: float = 300.0
    unit: str = "node"
    """What the horizontal policy adds and removes (its reasons name it: node, worker)."""
    rate_unit: str = "steps/s"
    """What the throughput it is given counts (its reasons name it)."""


@dataclass
class _State:
    throughput: dict[int, float] = field(default_factory=dict)
    """node count -> the last measured throughput (steps or samples per second)."""
    last_action_at: float | None = None
    scale_in_votes: int = 0
    started_at: float | None = None


def size_from_usage(usage: Sequence[NodeUsage], margin: float) -> Resources:
    """Per-node resources that hold the hungriest node's use with ``margin`` to spare."""
    peak = max((u.memory_peak_mib for u in usage), default=0)
    cores = max((u.cpu_cores for u in usage), default=0.0)
    return Resources(
        cpu=max(0.5, math.ceil(cores * margin * 2) / 2),
        memory_mib=max(64, math.ceil(peak * margin)),
    )


class ResourceOptimizer:
    """Plans from observations; `plan` is called periodically by the controller."""

    def __init__(self, config: OptimizerConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self._clock = clock
        self._s = _State()

    def observe_throughput(self, nodes: int, per_second: float) -> None:
        """The job's throughput while it ran on ``nodes`` nodes (the newest replaces older)."""
        if per_second > 0:
            self._s.throughput[nodes] = per_second

    def plan(
        self,
        nodes: int,
        size: Resources,
        usage: Sequence[NodeUsage],
        capacity: Capacity,
        sized: bool,
    ) -> ScalePlan:
        """The next action for a job running ``nodes`` nodes of ``size``; ``sized``: whether its
        resources were given or already chosen (otherwise the sizing policy runs first)."""
        now = self._clock()
        s, c = self._s, self.config
        if s.started_at is None:
            s.started_at = now
        if s.last_action_at is not None and now - s.last_action_at < c.cooldown_s:
            left = c.cooldown_s - (now - s.last_action_at)
            return ScalePlan(ScaleAction.NONE, nodes, reason=f"cooldown ({left:.0f}s left)")
        if not sized or self._memory_creeps(size, usage):
            if not usage or (not sized and now - s.started_at < c.sizing_window_s):
                return ScalePlan(ScaleAction.NONE, nodes, reason="measuring use for sizing")
            new = size_from_usage(usage, c.margin)
            if sized and new.memory_mib <= size.memory_mib:
                return ScalePlan(ScaleAction.NONE, nodes, reason="memory within its size")
            return self._act(
                ScalePlan(
                    ScaleAction.RESIZE,
                    nodes,
                    new,
                    f"{'memory creeps to' if sized else 'measured'} peak "
                    f"{max(u.memory_peak_mib for u in usage)} MiB and "
                    f"{max(u.cpu_cores for u in usage):.1f} cores per node: "
                    f"{new.memory_mib} MiB, {new.cpu:g} CPU (x{c.margin:g})",
                )
            )
        return self._horizontal(nodes, size, capacity)

    def _memory_creeps(self, size: Resources, usage: Sequence[NodeUsage]) -> bool:
        if not size.memory_mib:
            return False
        return any(u.memory_peak_mib > self.config.resize_at * size.memory_mib for u in usage)

    def _horizontal(self, nodes: int, size: Resources, capacity: Capacity) -> ScalePlan:
        s, c = self._s, self.config
        now_t = s.throughput.get(nodes)
        before = s.throughput.get(nodes - 1)
        if now_t is None:
            return ScalePlan(ScaleAction.NONE, nodes, reason=f"measuring throughput at {nodes}")
        gain = None if before is None else now_t / before - 1
        rates = "" if before is None else f" ({before:.3g} -> {now_t:.3g} {c.rate_unit})"
        if gain is not None and gain < c.speedup_threshold / 2 and nodes > c.min_nodes:
            s.scale_in_votes += 1
            if s.scale_in_votes >= c.scale_in_votes:
                return self._act(
                    ScalePlan(
                        ScaleAction.SCALE_IN,
                        nodes - 1,
                        reason=f"{c.unit} {nodes} added {gain:+.0%}{rates}, "
                        f"{s.scale_in_votes} plans in a row",
                    )
                )
            return ScalePlan(
                ScaleAction.NONE,
                nodes,
                reason=f"{c.unit} {nodes} added {gain:+.0%}: scale-in vote {s.scale_in_votes}",
            )
        s.scale_in_votes = 0
        if nodes >= c.max_nodes:
            return ScalePlan(ScaleAction.NONE, nodes, reason=f"at max {c.unit}s ({c.max_nodes})")
        if gain is not None and gain < c.speedup_threshold:
            return ScalePlan(
                ScaleAction.NONE,
                nodes,
                reason=f"{c.unit} {nodes} added {gain:+.0%} (< {c.speedup_threshold:.0%}): staying",
            )
        after = s.throughput.get(nodes + 1)
        if after is not None and after / now_t - 1 < c.speedup_threshold:
            return ScalePlan(
                ScaleAction.NONE,
                nodes,
                reason=f"{c.unit} {nodes + 1} added {after / now_t - 1:+.0%} when tried: staying",
            )
        if not capacity.fits(size):
            return ScalePlan(ScaleAction.NONE, nodes, reason=f"no capacity for another {c.unit}")
        why = (
            "first step from MIN" if gain is None else f"{c.unit} {nodes} added {gain:+.0%}{rates}"
        )
        return self._act(ScalePlan(ScaleAction.SCALE_OUT, nodes + 1, reason=why))

    def _act(self, plan: ScalePlan) -> ScalePlan:
        self._s.last_action_at = self._clock()
        self._s.scale_in_votes = 0
        return plan


PS_FILL = 0.7
"""An embedding server is full when its rows (and the replica of its neighbour's) take more
than this share of its memory."""


def plan_ps(
    servers: int,
    table_bytes: Sequence[int],
    memory_mib: int,
    max_servers: int,
    replicated: bool,
    fill: float = PS_FILL,
) -> ScalePlan:
    """The embedding servers' next step: one more server while the fullest one's rows (twice
    that with replicas: it also holds its neighbour's) pass ``fill`` of its memory, up to
    ``max_servers``. Buckets spread evenly, so one more server takes a share off each."""
    if not memory_mib or not table_bytes:
        return ScalePlan(ScaleAction.NONE, servers, reason="embedding servers have no memory size")
    held = max(table_bytes) * (2 if replicated else 1)
    used = held / (memory_mib << 20)
    if used <= fill:
        return ScalePlan(ScaleAction.NONE, servers, reason=f"embedding servers {used:.0%} full")
    if servers >= max_servers:
        return ScalePlan(
            ScaleAction.NONE,
            servers,
            reason=f"embedding servers {used:.0%} full, at their max ({max_servers})",
        )
    return ScalePlan(
        ScaleAction.SCALE_OUT,
        servers + 1,
        reason=f"the fullest embedding server holds {held >> 20} MiB of {memory_mib} MiB "
        f"({used:.0%} > {fill:.0%})",
    )
