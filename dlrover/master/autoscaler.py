"""Applies the resource optimiser's plans to a running job (`--auto-scale`).

Every ``interval_s`` it reads what the master knows (each running node's CPU and memory from
heartbeats, the job's step rate at its node count) and what the engine can still launch, asks
`ResourceOptimizer.plan`, logs every new plan with its reason (also in `dlrover status`), and
applies it through the node controller. Applied today: ``resize`` (every node relaunched at the
planned size: a job submitted without resources gets sized from its first minute, and memory
creeping towards its size grows it). Horizontal plans are logged, not yet applied: the node
controller launches MAX nodes at start.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from dlrover.master.job import JobMaster
from dlrover.master.nodes import NodeState
from dlrover.master.optimizer import (
    NodeUsage,
    OptimizerConfig,
    ResourceOptimizer,
    ScaleAction,
)

if TYPE_CHECKING:
    from dlrover.master.node_controller import NodeController

logger = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 30.0


class AutoScaler:
    """One job's auto-scaling loop, driven by its node controller's `step`."""

    def __init__(
        self,
        job: JobMaster,
        controller: NodeController,
        config: OptimizerConfig,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._job = job
        self._controller = controller
        self.optimizer = ResourceOptimizer(config, clock)
        self._interval_s = interval_s
        self._clock = clock
        self._next = clock() + interval_s
        self._sized = bool(controller.spec.resources.memory_mib)
        self._peaks: dict[str, int] = {}
        self._last: tuple[float, int] | None = None
        self._last_reason = ""

    def tick(self) -> None:
        """Plan (and act) if a period passed; cheap otherwise."""
        now = self._clock()
        if now < self._next or self._job.ended.is_set():
            return
        self._next = now + self._interval_s
        running = [n for n in self._job.nodes.all() if n.state == NodeState.RUNNING]
        if not running:
            return
        for n in running:
            self._peaks[n.node_id] = max(self._peaks.get(n.node_id, 0), n.memory_bytes >> 20)
        usage = [NodeUsage(n.node_id, n.cpu_percent / 100, self._peaks[n.node_id]) for n in running]
        step = max(n.step for n in running)
        if self._last is not None and step > self._last[1] and now > self._last[0]:
            self.optimizer.observe_throughput(
                len(running), (step - self._last[1]) / (now - self._last[0])
            )
        self._last = (now, step)
        spec = self._controller.spec
        plan = self.optimizer.plan(
            len(running), spec.resources, usage, self._controller.engine.capacity(), self._sized
        )
        if plan.reason != self._last_reason:
            self._last_reason = plan.reason
            self._job.scale_summary = f"auto-scale: {plan.action.value}: {plan.reason}"
            log = logger.info if plan.action is not ScaleAction.NONE else logger.debug
            log("%s", self._job.scale_summary)
        if plan.action is ScaleAction.RESIZE and plan.resources is not None:
            self._sized = True
            self._peaks.clear()
            self._controller.resize(plan.resources, plan.reason)
        elif plan.action in (ScaleAction.SCALE_OUT, ScaleAction.SCALE_IN):
            logger.info(
                "auto-scale: %s to %d nodes is not applied yet", plan.action.value, plan.nodes
            )
