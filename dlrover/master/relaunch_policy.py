"""The one relaunch policy of every role controller: relaunch or not, and the replacement's spec."""

from __future__ import annotations

import dataclasses
import math

from dlrover.api.master import FailureClass
from dlrover.constants import (
    CANNOT_START_EXIT_CODE,
    DEFAULT_OOM_MAX_MEMORY_MIB,
    DEFAULT_OOM_MEMORY_FACTOR,
)
from dlrover.engines.base import FailureReason, InvalidNodeSpecError, NodeEvent, NodeSpec, Resources
from dlrover.master.node_policy import (
    NodeLossDecision,
    NodeLossObservation,
    NodeLossReason,
    decide_node_loss,
)


@dataclasses.dataclass(frozen=True)
class OomPolicy:
    """How a node killed for memory is relaunched: memory times `factor`, never above the cap."""

    factor: float = DEFAULT_OOM_MEMORY_FACTOR
    """Multiplier applied to memory_mib after each OOM kill (> 1)."""
    max_memory_mib: int = DEFAULT_OOM_MAX_MEMORY_MIB
    """Cap; a node that was OOM-killed at the cap is not relaunched with the same size."""

    def __post_init__(self) -> None:
        if not self.factor > 1.0:
            raise InvalidNodeSpecError(f"OOM memory factor is {self.factor}; it must be > 1")
        if self.max_memory_mib <= 0:
            raise InvalidNodeSpecError(f"OOM max memory is {self.max_memory_mib} MiB; must be > 0")


def memory_after_oom(resources: Resources, policy: OomPolicy) -> Resources | None:
    """Resources for the replacement of an OOM-killed node, or None when it cannot grow any more
    (already at the cap, or no memory request to grow from)."""
    if resources.memory_mib <= 0 or resources.memory_mib >= policy.max_memory_mib:
        return None
    grown = min(math.ceil(resources.memory_mib * policy.factor), policy.max_memory_mib)
    shm = resources.shm_mib
    if shm:
        # Keep /dev/shm the same share of memory: flash checkpoint sizes it from the model.
        shm = math.ceil(shm * grown / resources.memory_mib)
    return dataclasses.replace(resources, memory_mib=grown, shm_mib=shm)


def replacement_spec(event: NodeEvent, policy: OomPolicy) -> NodeSpec | None:
    """The spec to launch for a failed node: same slot, next relaunch count, more memory after an
    OOM kill. None when the failure cannot be cured by a relaunch of that size."""
    if event.reason is FailureReason.OOM_KILLED:
        grown = memory_after_oom(event.spec.resources, policy)
        if grown is None:
            return None
        return event.spec.replacement(grown)
    return event.spec.replacement()


def failure_class_of(event: NodeEvent) -> FailureClass:
    """The diagnosis class of an engine's failure event."""
    reason = event.reason
    if event.exit_code == CANNOT_START_EXIT_CODE:
        return FailureClass.USER_ERROR  # its program cannot start
    if reason is FailureReason.OOM_KILLED:
        return FailureClass.OOM
    if reason is FailureReason.SIGNAL:
        return FailureClass.SIGNAL
    if reason is FailureReason.EXIT_CODE:
        return FailureClass.EXIT_CODE
    return FailureClass.NODE_LOST  # lost, preempted, never launched, unknown


@dataclasses.dataclass(frozen=True)
class RelaunchPolicy:
    """The relaunch rule of every role controller (all-reduce workers, TensorFlow roles,
    embedding servers): a slot is relaunched while it has relaunches left (`decide_node_loss`),
    with more memory after an OOM kill (`replacement_spec`). Pure: no I/O, no clock."""

    max_relaunches: int
    """Relaunches a node slot may use (the job spec's max_relaunches)."""
    oom: OomPolicy = dataclasses.field(default_factory=OomPolicy)

    def decide(
        self,
        node_id: str,
        reason: NodeLossReason,
        relaunch_count: int,
        alive_nodes: int = 0,
        min_nodes: int = 1,
    ) -> NodeLossDecision:
        """Relaunch the slot whose node ``node_id`` is lost, having used ``relaunch_count``
        relaunches? With ``alive_nodes`` and ``min_nodes`` (all-reduce workers) the survivors may
        go on smaller instead; a role without that choice (TensorFlow roles, embedding servers)
        passes neither, so it is relaunch or fail."""
        return decide_node_loss(
            NodeLossObservation(
                node_id=node_id,
                reason=reason,
                relaunch_count=relaunch_count,
                max_relaunches=self.max_relaunches,
                alive_nodes=alive_nodes,
                min_nodes=min_nodes,
            )
        )

    def replacement(self, event: NodeEvent) -> NodeSpec | None:
        """The spec of the failed node's replacement (see `replacement_spec`); None when an
        OOM-killed node cannot grow."""
        return replacement_spec(event, self.oom)

    @staticmethod
    def loss_reason(event: NodeEvent) -> NodeLossReason:
        """Why the engine's failure event counts as a lost node."""
        if event.reason is FailureReason.OOM_KILLED:
            return NodeLossReason.OOM_KILLED
        return NodeLossReason.PROCESS_EXITED
