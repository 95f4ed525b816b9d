"""Sizes the roles of a TensorFlow job submitted without resources from what their nodes measured.

With ``auto_scale``, every role whose nodes run without a memory limit is measured from the
moment all the job's nodes run and the chief reported finished batches: each node's CPU and its
peak resident memory, from the usage reports the nodes send (`dlrover.coordination.TfNodeUsage`).
A ps holds its share of the variables from the chief's build and its optimizer slots from the
first step, so by then its peak is what its variables and slots take with TensorFlow's own. After
``sizing_window_s`` each role gets the resources `size_from_usage` gives (peak x margin, cores
used x margin), and the controller gives its nodes that size in place where the engine can
(the local engine raises the running node's cgroup limits: no restart, the chief keeps its
state) and relaunches them at that size where it cannot. On the local engine those are cgroup
limits from then on (an underestimate is an OOM kill, which relaunches the node 1.5x bigger).
A chief that never reports progress (a plain ``ParameterServerStrategy`` program that does not
use PsTrainer) does not hold the sizing back: its roles are measured for NO_PROGRESS_WINDOWS
windows from when every node runs, and the plan's reason says so (worker counts, which follow
throughput, are not planned for it). Each plan is logged with its reason and how it was applied ("resized in place" or
"relaunched"), kept as the job's latest plan (`dlrover status`) and put on the timeline
(dashboard, the plans an ended job leaves).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from dlrover.engines.base import Resources
from dlrover.master.job import JobMaster
from dlrover.master.optimizer import NodeUsage, size_from_usage
from dlrover.master.roles import RoleNode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoleSize:
    """A plan for one role: the resources its nodes get, and why."""

    role: str
    resources: Resources
    reason: str


def size_role(role: str, usage: Sequence[NodeUsage], margin: float) -> RoleSize:
    """The size of ``role``'s nodes from what they used (the hungriest node's use x margin)."""
    resources = size_from_usage(usage, margin)
    peak = max(u.memory_peak_mib for u in usage)
    cores = max(u.cpu_cores for u in usage)
    reason = (
        f"{role}: measured peak {peak} MiB and {cores:.1f} cores per node: "
        f"{resources.memory_mib} MiB, {resources.cpu:g} CPU (x{margin:g})"
    )
    return RoleSize(role, resources, reason)


class SizedController(Protocol):
    """What the sizer needs of the TensorFlow job's controller."""

    counts: dict[str, int]

    @property
    def clock(self) -> Callable[[], float]:
        """The controller's clock."""
        ...

    def sized(self, role: str) -> bool:
        """Whether ``role``'s nodes have a memory limit."""
        ...

    def trained(self) -> bool:
        """Whether the chief reported finished batches (the ps hold variables and slots)."""
        ...

    def role_nodes(self) -> list[RoleNode]:
        """Every slot's current attempt."""
        ...

    def resize_role(self, role: str, resources: Resources, reason: str) -> str:
        """Give ``role``'s nodes ``resources`` (in place, else relaunched); says which."""
        ...


NO_PROGRESS_WINDOWS = 3
"""A job whose chief reports no progress (a plain TF_CONFIG program, not PsTrainer) is measured
for this many sizing windows from when all its nodes run: no report says when its variables
are built and trained, so a longer watch stands in for one."""


class TfSizer:
    """Sizes each unsized role of one TensorFlow job once (`tick` from the controller's step).

    Invariant: a role is sized at most once, and only from reports of nodes that all run: a
    node relaunched meanwhile starts the measurement over."""

    def __init__(
        self,
        job: JobMaster,
        controller: SizedController,
        sizing_window_s: float,
        margin: float = 1.3,
        clock: Callable[[], float] | None = None,
        no_progress_window_s: float | None = None,
    ) -> None:
        self._job = job
        self._controller = controller
        self._window_s = sizing_window_s
        self._no_progress_s = (
            NO_PROGRESS_WINDOWS * sizing_window_s
            if no_progress_window_s is None
            else no_progress_window_s
        )
        self._margin = margin
        self._clock = clock or controller.clock
        self._since: float | None = None
        """When every node was last seen running (None: not all run now)."""
        self._trained = False
        """Whether the measurement under way started after the chief's first progress report."""
        self._told = False
        self._peaks: dict[str, int] = {}
        self._cores: dict[str, float] = {}
        self.sized: set[str] = {
            role for role, count in controller.counts.items() if count and controller.sized(role)
        }
        """Roles with a size: given in the spec, or planned here."""

    def _reset(self) -> None:
        self._since = None
        self._peaks.clear()
        self._cores.clear()

    def tick(self) -> None:
        """Plan once the job's nodes ran for the window; cheap otherwise."""
        nodes = self._controller.role_nodes()
        # Given sizes count from the first nodes on: the sizer is made before they launch.
        self.sized.update(r.role for r in nodes if self._controller.sized(r.role))
        if self._job.lifecycle.ended.is_set() or all(r.role in self.sized for r in nodes):
            return
        now = self._clock()
        # A node without a usage report yet (or with reports off) is not measured: no size
        # is ever planned from a zero.
        measured = all(r.state == "running" and r.memory_bytes for r in nodes)
        if not measured:
            self._reset()
            return
        trained = self._controller.trained()
        if trained != self._trained:  # the first progress report: measure from now on
            self._reset()
            self._trained = trained
        if self._since is None:
            self._since = now
        for r in nodes:
            self._peaks[r.node_id] = max(self._peaks.get(r.node_id, 0), r.memory_bytes >> 20)
            self._cores[r.node_id] = max(self._cores.get(r.node_id, 0.0), r.cpu_percent / 100)
        window = self._window_s if trained else self._no_progress_s
        if now - self._since < window:
            if not trained and not self._told and now - self._since >= self._window_s:
                self._told = True
                note = (
                    "auto-scale: the chief reports no progress (its program does not use "
                    f"PsTrainer): sizing the roles from memory and CPU alone after "
                    f"{self._no_progress_s:.0f}s of running; worker counts are not planned "
                    "from throughput"
                )
                logger.info("%s", note)
                self._job.diagnostics.scale_summary = note
            return
        for role in sorted({r.role for r in nodes} - self.sized):
            usage = [
                NodeUsage(r.node_id, self._cores[r.node_id], self._peaks[r.node_id])
                for r in nodes
                if r.role == role
            ]
            plan = size_role(role, usage, self._margin)
            reason = plan.reason
            if not trained:
                reason += (
                    f", over {window:.0f}s of running without progress reports (the program "
                    "does not use PsTrainer: worker counts are not planned from throughput)"
                )
            self.sized.add(role)
            done = self._controller.resize_role(role, plan.resources, reason)
            summary = f"auto-scale: resize {reason}: {done}"
            logger.info("%s", summary)
            self._job.diagnostics.scale_plan(summary, summary.removeprefix("auto-scale: "))
        self._reset()
