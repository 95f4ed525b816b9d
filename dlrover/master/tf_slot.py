"""One node slot of a TensorFlow job (role, index) and its current attempt, as the master's
TfController keeps it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from dlrover.coordination import TfNodeUsage
from dlrover.engines.base import NodeSpec, Resources
from dlrover.master.roles import RoleNode


@dataclasses.dataclass
class Slot:
    """One node slot (role, index) and its current attempt.

    States of the attempt: launched (``registered`` empty) -> registered (its address known) ->
    serving (a ps or worker whose TF server answers; set by the server itself). A relaunch starts
    over at launched; ``address`` keeps the slot's published address meanwhile."""

    role: str
    index: int
    spec: NodeSpec
    launched_at: float
    address: str = ""
    """The slot's address in the published cluster spec ("" before the first)."""
    registered: str = ""
    """The address the current attempt registered ("" until it does)."""
    serving: bool = False
    usage: TfNodeUsage | None = None
    """The current attempt's last usage report (None before one)."""
    ended: str = ""
    """succeeded or failed once the slot's last attempt ended for good ("" until then)."""

    @property
    def state(self) -> str:
        """pending, running, succeeded or failed: running once the attempt serves (ps,
        worker), registered (chief) or reported its usage (evaluator)."""
        if self.ended:
            return self.ended
        up = {"ps": self.serving, "worker": self.serving, "chief": bool(self.registered)}
        return "running" if up.get(self.role, self.usage is not None) else "pending"

    def role_node(self) -> RoleNode:
        """The current attempt as `dlrover status` shows it: state, relaunches, usage, limit."""
        usage = self.usage
        return RoleNode(
            node_id=self.spec.node_id,
            role=self.role,
            index=self.index,
            state=self.state,
            relaunches=self.spec.relaunch_count,
            cpu_percent=usage.cpu_percent if usage else 0.0,
            memory_bytes=usage.memory_bytes if usage else 0,
            memory_limit_bytes=self.spec.resources.memory_mib * 2**20,
            pid=usage.pid if usage else 0,
        )


def attempt_record(spec: NodeSpec) -> dict[str, Any]:
    """What the master's state keeps of one attempt (`attempt_of` makes it again)."""
    return {
        "index": spec.rank,
        "relaunch_count": spec.relaunch_count,
        "resources": dataclasses.asdict(spec.resources),
    }


def attempt_of(node_spec: Callable[[int, int], NodeSpec], record: dict[str, Any]) -> NodeSpec:
    """The attempt ``record`` names: ``node_spec(index, relaunch_count)`` with its resources."""
    spec = node_spec(int(record["index"]), int(record["relaunch_count"]))
    return dataclasses.replace(spec, resources=Resources(**record["resources"]))
