"""Applies the resource optimiser's plans to a running job (`--auto-scale`).

Every ``interval_s`` it reads what the master knows (each running node's CPU and memory from
heartbeats, the job's step rate at its node count) and what the engine can still launch, asks
`ResourceOptimizer.plan`, logs every new plan with its reason (also in `dlrover status`), and
applies it through the node controller: ``resize`` relaunches every node at the planned size (a
job submitted without resources gets sized from its first minute; memory creeping towards its
size grows it), ``scale_out`` / ``scale_in`` add or remove a node within ``--nnodes MIN:MAX``
(a job that may scale starts at MIN nodes).

Throughput is the job's step rate over the current rendezvous round at its full size, from the
first step seen to advance in it (so a restart's pause never counts against a node count), with
the times the heartbeats carrying the steps arrived. It is the job's
throughput when a step is the same work at any size: `ElasticTrainer` keeps the global batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from dlrover.master.job import JobMaster
from dlrover.master.nodes import Node, NodeState
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
DEFAULT_WINDOW_S = 10.0
"""The shortest span a step rate is measured over before it counts. Heartbeats carry steps every
~2 s and a step's time varies with load and checkpoints; a rate over a few seconds can be off by
15%, enough to keep a node that adds nothing (the rate at one count is compared with another's)."""
SETTLE_S = 3.0
"""After a round forms, reports of the round before may still arrive for this long (a heartbeat
interval and the agent's progress poll)."""


class AutoScaler:
    """One job's auto-scaling loop, driven by its node controller's `step`."""

    def __init__(
        self,
        job: JobMaster,
        controller: NodeController,
        config: OptimizerConfig,
        interval_s: float = DEFAULT_INTERVAL_S,
        window_s: float = DEFAULT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._job = job
        self._controller = controller
        self.optimizer = ResourceOptimizer(config, clock)
        self._interval_s = interval_s
        self._window_s = window_s
        self._clock = clock
        self._next = clock() + interval_s
        self._sized = bool(controller.spec.resources.memory_mib)
        self._peaks: dict[str, int] = {}
        self._base: tuple[int, float, int, bool] | None = None
        """(round, time, step, whether it is the first advance seen in the round): where the
        round's step rate is measured from."""
        self._round_seen = 0.0
        """When a plan first saw the current round."""
        self._last_reason = ""

    @property
    def horizontal(self) -> bool:
        """Whether the job may scale out and in (``--nnodes MIN:MAX`` with MIN < MAX)."""
        c = self.optimizer.config
        return c.min_nodes < c.max_nodes

    def tick(self) -> None:
        """Plan (and act) if a period passed; cheap otherwise."""
        now = self._clock()
        if now < self._next or self._job.lifecycle.ended.is_set():
            return
        self._next = now + self._interval_s
        running = [n for n in self._job.members.nodes.all() if n.state == NodeState.RUNNING]
        if not running:
            return
        for n in running:
            self._peaks[n.node_id] = max(self._peaks.get(n.node_id, 0), n.memory_bytes >> 20)
        usage = [NodeUsage(n.node_id, n.cpu_percent / 100, self._peaks[n.node_id]) for n in running]
        self._measure(now, running)
        spec = self._controller.spec
        slots = self._controller.slots
        plan = self.optimizer.plan(
            slots, spec.resources, usage, self._controller.engine.capacity(), self._sized
        )
        if plan.reason != self._last_reason:
            self._last_reason = plan.reason
            summary = f"auto-scale: {plan.action.value}: {plan.reason}"
            acts = plan.action is not ScaleAction.NONE
            (logger.info if acts else logger.debug)("%s", summary)
            self._job.diagnostics.scale_plan(
                summary, f"{plan.action.value}: {plan.reason}" if acts else ""
            )
        if plan.action is ScaleAction.RESIZE and plan.resources is not None:
            self._sized = True
            self._peaks.clear()
            self._controller.resize(plan.resources, plan.reason)
        elif plan.action in (ScaleAction.SCALE_OUT, ScaleAction.SCALE_IN):
            self._base = None  # the next round is measured afresh
            self._controller.scale_to(plan.nodes, plan.reason)

    def _measure(self, now: float, running: list[Node]) -> None:
        """Observe the step rate since the previous plan if both saw the same full round."""
        world = self._job.rendezvous.world if self._job.rendezvous is not None else None
        members = {m.node_id for m in world.members} if world is not None else set()
        in_world = [n for n in running if n.node_id in members]
        if world is None or len(in_world) != len(members):
            self._base = None  # re-forming, or a member is not back yet
            return
        lead = max(in_world, key=lambda n: n.step)
        step, at = lead.step, lead.step_at  # when the master heard of the step
        base = self._base
        if base is None or base[0] != world.round:
            self._base = (world.round, at, step, False)
            self._round_seen = now
        elif now - self._round_seen < SETTLE_S or (not base[3] and step <= base[2]):
            # Steps of the round before may still arrive (heartbeats lag); then the new round
            # must be seen to advance: its start-up never counts.
            self._base = (world.round, at, step, False)
        elif not base[3]:
            self._base = (world.round, at, step, True)
        elif step > base[2] and at - base[1] >= self._window_s:
            # The rate over the whole round so far: longer windows, less heartbeat jitter.
            rate = (step - base[2]) / (at - base[1])
            logger.debug(
                "auto-scale: %d nodes: steps %d -> %d in %.1fs: %.2f steps/s",
                len(members), base[2], step, at - base[1], rate,
            )  # fmt: skip
            self.optimizer.observe_throughput(len(members), rate)
