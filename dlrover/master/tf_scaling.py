"""Scales the workers and ps of a TensorFlow job from what the master measures of it.

Workers:
With ``auto_scale`` and ``roles.worker.max_count`` above ``count``, the job starts with
``count`` workers. Every ``interval_s`` the `TfWorkerScaler` takes the job's samples/s, measured
only from the chief's reports on the current cluster (a re-partition's pause never counts against
a size) over at least ``window_s``, and asks the optimiser's horizontal policy
(`dlrover.master.optimizer.ResourceOptimizer`) for a plan: add a worker while the last one added
raised samples/s by the threshold, remove the last one when it adds nothing, within
``count..max_count`` and what the engine can still launch. A ps that is saturated (its CPU at its
limit) holds back any addition: more workers would only queue on it. The controller applies the
plan (`TfController.scale_workers`); the chief starts again on the new cluster from a checkpoint
with its data position, so every sample is still trained once.

ps (`TfPsScaler`): a ps whose CPU is well above the others' (a hot embedding shard) or at its
limit (saturated) adds a ps, up to ``roles.ps.max_count``, through the chief's re-partition from
a checkpoint; a ps whose memory creeps past 90% of its limit resizes the ps (peak x 1.3) before
the OOM kill: in place where the engine can (the same ps process goes on with a higher limit),
else relaunched at that size (the chief restores it).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from dlrover.coordination import TfProgress
from dlrover.engines.base import Capacity, Resources
from dlrover.master.job import JobMaster
from dlrover.master.optimizer import ResourceOptimizer, ScaleAction, ScalePlan
from dlrover.master.ps_load import Throughput
from dlrover.master.roles import RoleNode

logger = logging.getLogger(__name__)

PS_SATURATED = 0.9
"""A ps is saturated when it uses this share of its CPU (its limit, else the host's cores)."""


def saturated_ps(
    ps: Sequence[RoleNode], cores: Sequence[float], share: float = PS_SATURATED
) -> str | None:
    """Why the ps are saturated (the first ps whose CPU use is ``share`` of its ``cores``),
    or None."""
    for node, limit in zip(ps, cores, strict=True):
        if limit > 0 and node.cpu_percent / 100 >= share * limit:
            return (
                f"ps {node.index} ({node.node_id}) uses {node.cpu_percent / 100:.1f} of "
                f"{limit:g} cores"
            )
    return None


class ScaledController(Protocol):
    """What the worker scaler needs of the TensorFlow job's controller."""

    counts: dict[str, int]
    cluster_version: int
    throughput: Throughput
    workers_changing: bool

    def role_nodes(self) -> list[RoleNode]:
        """Every slot's current attempt."""
        ...

    def role_resources(self, role: str) -> Resources:
        """What one node of ``role`` asks for now."""
        ...

    def settled(self) -> bool:
        """Whether every role is sized and nothing is being relaunched for a plan."""
        ...

    def scale_workers(self, count: int) -> None:
        """Run ``count`` workers."""
        ...


class TfWorkerScaler:
    """Plans the worker count of one TensorFlow job (`tick` from the controller's step).

    Invariant: at most one change is underway: no plan is made until the chief trains on the
    cluster of the last change and its rate there was measured over ``window_s``."""

    def __init__(
        self,
        job: JobMaster,
        controller: ScaledController,
        optimizer: ResourceOptimizer,
        capacity: Callable[[], Capacity],
        host_cores: float,
        interval_s: float,
        window_s: float,
        clock: Callable[[], float],
    ) -> None:
        self._job = job
        self._controller = controller
        self._optimizer = optimizer
        self._capacity = capacity
        self._host_cores = host_cores
        self._interval_s = interval_s
        self._window_s = window_s
        self._clock = clock
        self._throughput = Throughput(window_s=max(window_s, 1.0) * 3)
        """The rates on the current cluster only (cleared when it changes)."""
        self._version = -1
        """The cluster version the rates are measured on."""
        self._last_plan: float | None = None
        self.plans: list[ScalePlan] = []
        """Every plan that acted (tests and the benchmark read them)."""

    def _observe(self, latest: TfProgress | None) -> bool:
        """Take the chief's newest report; whether it trains on the current cluster."""
        version = self._controller.cluster_version
        if latest is None or (latest.cluster_version and latest.cluster_version != version):
            return False
        if version != self._version:
            self._version = version
            self._throughput = Throughput(window_s=max(self._window_s, 1.0) * 3)
        self._throughput.add(latest)
        return True

    def tick(self) -> None:
        """Plan every ``interval_s`` once the current size's rate is measured; cheap otherwise."""
        c = self._controller
        if self._job.lifecycle.ended.is_set() or c.workers_changing or not c.settled():
            return
        if not self._observe(c.throughput.latest):
            return
        now = self._clock()
        if self._last_plan is not None and now - self._last_plan < self._interval_s:
            return
        rates = self._throughput.rates()
        if rates.span_s < self._window_s:
            return
        self._last_plan = now
        workers = c.counts["worker"]
        self._optimizer.observe_throughput(workers, rates.samples_per_s)
        nodes = c.role_nodes()
        ps = [n for n in nodes if n.role == "ps"]
        limit = c.role_resources("ps").cpu
        busy = saturated_ps(ps, [limit or self._host_cores] * len(ps))
        if busy is not None:
            plan = ScalePlan(ScaleAction.NONE, workers, reason=f"the ps are saturated: {busy}")
        else:
            size = c.role_resources("worker")
            plan = self._optimizer.plan(workers, size, [], self._capacity(), sized=True)
        where = f"{workers} workers at {rates.samples_per_s:.0f} samples/s"
        if plan.action is ScaleAction.NONE:
            self._job.diagnostics.scale_plan(f"auto-scale: {where}: {plan.reason}")
            return
        summary = f"auto-scale: {plan.action.value} worker {workers} -> {plan.nodes}: {plan.reason}"
        logger.info("%s (%s)", summary, where)
        self._job.diagnostics.scale_plan(summary, summary.removeprefix("auto-scale: "))
        self.plans.append(plan)
        c.scale_workers(plan.nodes)


HOT_FACTOR = 2.0
"""A ps is hot when its CPU is at least this many times the mean of the others'."""
HOT_FLOOR_CORES = 0.25
"""...and at least this many cores: idle ps differ by noise, not by load."""
PS_VOTES = 2
"""Plans in a row that must find a ps hot or saturated before one is added."""


@dataclass(frozen=True)
class PsLoad:
    """What one ps used lately: its mean CPU since the last plan and its peak memory."""

    node_id: str
    index: int
    cpu_cores: float
    memory_peak_mib: int


def hot_ps(load: Sequence[PsLoad], factor: float = HOT_FACTOR) -> str | None:
    """Why one ps is hot (its CPU ``factor`` times the others' mean, and busy), or None."""
    for ps in load:
        others = [p.cpu_cores for p in load if p is not ps]
        if not others or ps.cpu_cores < HOT_FLOOR_CORES:
            continue
        mean = sum(others) / len(others)
        if ps.cpu_cores >= factor * max(mean, 0.01):
            return (
                f"ps {ps.index} ({ps.node_id}) is hot: {ps.cpu_cores:.2f} cores, "
                f"{ps.cpu_cores / max(mean, 0.01):.1f}x the others' {mean:.2f}"
            )
    return None


def plan_ps(
    load: Sequence[PsLoad],
    size: Resources,
    cores: float,
    max_count: int,
    margin: float = 1.3,
    resize_at: float = 0.9,
) -> ScalePlan:
    """The ps' next step from their load: a ps whose memory peak passed ``resize_at`` of its
    limit resizes the ps (peak x ``margin``) before an OOM kill; a hot or saturated ps (its
    CPU at 90% of ``cores``, the limit or the host's) adds one ps, up to ``max_count``: the
    variables are partitioned again over one more, which splits the hot part."""
    count = len(load)
    limit = size.memory_mib
    creeping = [p for p in load if limit and p.memory_peak_mib > resize_at * limit]
    if creeping:
        worst = max(creeping, key=lambda p: p.memory_peak_mib)
        memory = math.ceil(worst.memory_peak_mib * margin)
        return ScalePlan(
            ScaleAction.RESIZE,
            count,
            dataclasses.replace(size, memory_mib=memory),
            f"ps {worst.index} ({worst.node_id}) memory creeps to {worst.memory_peak_mib} of "
            f"{limit} MiB: {memory} MiB (x{margin:g})",
        )
    nodes = [RoleNode(p.node_id, "ps", p.index, "running", 0, p.cpu_cores * 100) for p in load]
    why = saturated_ps(nodes, [cores] * count)
    why = f"the ps are saturated: {why}" if why else hot_ps(load)
    if why is None:
        spread = ", ".join(f"{p.cpu_cores:.2f}" for p in load)
        return ScalePlan(ScaleAction.NONE, count, reason=f"ps load even ({spread} cores)")
    if count >= max_count:
        return ScalePlan(ScaleAction.NONE, count, reason=f"{why}; at max ps ({max_count})")
    return ScalePlan(ScaleAction.SCALE_OUT, count + 1, reason=why)


class PsScaledController(Protocol):
    """What the ps scaler needs of the TensorFlow job's controller."""

    counts: dict[str, int]
    workers_changing: bool

    def role_nodes(self) -> list[RoleNode]:
        """Every slot's current attempt."""
        ...

    def role_resources(self, role: str) -> Resources:
        """What one node of ``role`` asks for now."""
        ...

    def settled(self) -> bool:
        """Whether every role is sized and every ps and worker serves."""
        ...

    def request_scale(self, role: str, count: int) -> tuple[str, int]:
        """Ask for ``count`` ps; ValueError while a scaling is in progress."""
        ...

    def resize_role(self, role: str, resources: Resources, reason: str) -> str:
        """Give ``role``'s nodes ``resources`` (in place, else relaunched); says which."""
        ...


class TfPsScaler:
    """Plans the ps of one TensorFlow job from their load (`tick` from the controller's step).

    Invariant: a plan uses only reports of the current ps attempts, all serving, gathered
    over ``interval_s``; a ps is added only after ``votes`` plans in a row found one hot or
    saturated (one busy report is noise), a resize acts at once (an OOM kill is near)."""

    def __init__(
        self,
        job: JobMaster,
        controller: PsScaledController,
        max_count: int,
        host_cores: float,
        interval_s: float,
        clock: Callable[[], float],
        margin: float = 1.3,
        votes: int = PS_VOTES,
    ) -> None:
        self._job = job
        self._controller = controller
        self._max_count = max_count
        self._host_cores = host_cores
        self._interval_s = interval_s
        self._clock = clock
        self._margin = margin
        self._votes = votes
        self._hot_votes = 0
        self._since: float | None = None
        self._cpu: dict[str, list[float]] = {}
        self._peaks: dict[str, int] = {}
        self.plans: list[ScalePlan] = []
        """Every plan that acted."""

    def _restart(self) -> None:
        self._since = None
        self._cpu.clear()
        self._peaks.clear()

    def tick(self) -> None:
        """Sample the ps' usage; plan every ``interval_s``."""
        c = self._controller
        if self._job.lifecycle.ended.is_set() or c.workers_changing or not c.settled():
            self._restart()
            return
        ps = [n for n in c.role_nodes() if n.role == "ps"]
        if not all(n.memory_bytes for n in ps):
            return  # a ps without a usage report yet: nothing to compare
        now = self._clock()
        if self._since is None or set(self._cpu) != {n.node_id for n in ps}:
            self._restart()
            self._since = now
            self._cpu = {n.node_id: [] for n in ps}
        for n in ps:
            self._cpu[n.node_id].append(n.cpu_percent / 100)
            self._peaks[n.node_id] = max(self._peaks.get(n.node_id, 0), n.memory_bytes >> 20)
        if now - self._since < self._interval_s:
            return
        load = [
            PsLoad(
                n.node_id,
                n.index,
                sum(self._cpu[n.node_id]) / len(self._cpu[n.node_id]),
                self._peaks[n.node_id],
            )
            for n in ps
        ]
        self._restart()
        size = c.role_resources("ps")
        plan = plan_ps(load, size, size.cpu or self._host_cores, self._max_count, self._margin)
        if plan.action is ScaleAction.SCALE_OUT:
            self._hot_votes += 1
            if self._hot_votes < self._votes:
                plan = ScalePlan(
                    ScaleAction.NONE,
                    plan.nodes - 1,
                    reason=f"{plan.reason} (vote {self._hot_votes})",
                )
        else:
            self._hot_votes = 0
        if plan.action is ScaleAction.NONE:
            self._job.diagnostics.scale_plan(f"auto-scale: {plan.reason}")
            return
        self._hot_votes = 0
        count = c.counts["ps"]
        what = "resize ps" if plan.action is ScaleAction.RESIZE else f"scale_out ps {count} -> "
        summary = f"auto-scale: {what}{plan.nodes if plan.resources is None else ''}: {plan.reason}"
        try:
            if plan.resources is not None:
                summary += f": {c.resize_role('ps', plan.resources, plan.reason)}"
            else:
                c.request_scale("ps", plan.nodes)
        except ValueError as e:  # a ps scaling asked by hand is underway
            self._job.diagnostics.scale_plan(f"auto-scale: {plan.reason}; waiting: {e}")
            return
        logger.info("%s", summary)
        self._job.diagnostics.scale_plan(summary, summary.removeprefix("auto-scale: "))
        self.plans.append(plan)
