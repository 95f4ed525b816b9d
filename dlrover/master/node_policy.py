"""The master's pure policy for a lost node: relaunch it, go on smaller, or fail."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from dlrover.decisions import FailureAction


class NodeLossReason(Enum):
    """Why the master considers a node lost."""

    HEARTBEAT_TIMEOUT = "heartbeat_timeout"
    PROCESS_EXITED = "process_exited"
    """The engine reports the agent process (or pod/actor) gone."""
    OOM_KILLED = "oom_killed"
    """The engine reports the node killed for memory."""


@dataclass(frozen=True)
class NodeLossObservation:
    """The master's view when one node is lost."""

    node_id: str
    reason: NodeLossReason
    relaunch_count: int
    """Replacements already launched for this node slot."""
    max_relaunches: int
    alive_nodes: int
    """Nodes still running, not counting the lost one."""
    min_nodes: int

    def __post_init__(self) -> None:
        if min(self.relaunch_count, self.max_relaunches, self.alive_nodes) < 0:
            raise ValueError("relaunch_count, max_relaunches and alive_nodes must be >= 0")
        if self.min_nodes < 1:
            raise ValueError(f"min_nodes must be >= 1, got {self.min_nodes}")


@dataclass(frozen=True)
class NodeLossDecision:
    """The master's answer to a lost node.

    `action` is RELAUNCH_NODE (launch a replacement), RESTART_PROCESSES (no replacement, the
    survivors re-form at the smaller size) or FAIL. `survivors_continue` says whether the
    survivors re-form now without waiting for the replacement (at least min_nodes remain).
    """

    action: FailureAction
    survivors_continue: bool
    reason: str


def decide_node_loss(observation: NodeLossObservation) -> NodeLossDecision:
    """Relaunch while relaunches remain; survivors go on when at least min_nodes are alive."""
    enough = observation.alive_nodes >= observation.min_nodes
    size = f"{observation.alive_nodes} alive, min {observation.min_nodes}"
    lost = f"node {observation.node_id} lost ({observation.reason.value})"
    if observation.relaunch_count < observation.max_relaunches:
        then = "survivors re-form now" if enough else "survivors wait for the replacement"
        return NodeLossDecision(
            FailureAction.RELAUNCH_NODE,
            enough,
            f"{lost}: relaunch {observation.relaunch_count + 1}/{observation.max_relaunches}, "
            f"{then} ({size})",
        )
    if enough:
        return NodeLossDecision(
            FailureAction.RESTART_PROCESSES,
            True,
            f"{lost}: no relaunch left ({observation.max_relaunches}), survivors re-form "
            f"smaller ({size})",
        )
    return NodeLossDecision(
        FailureAction.FAIL,
        False,
        f"{lost}: no relaunch left ({observation.max_relaunches}) and too few nodes ({size})",
    )
