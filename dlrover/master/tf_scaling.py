"""Adds and removes the workers of a TensorFlow job from its measured throughput.

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
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
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
        if self._job.ended.is_set() or c.workers_changing or not c.settled():
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
