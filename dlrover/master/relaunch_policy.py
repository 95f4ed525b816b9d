"""Pure helpers for the controller: the spec of a failed node's replacement (OOM -> more memory)."""

from __future__ import annotations

import dataclasses
import math

from dlrover.engines.base import FailureReason, InvalidNodeSpecError, NodeEvent, NodeSpec, Resources

DEFAULT_OOM_MEMORY_FACTOR = 1.5
DEFAULT_OOM_MAX_MEMORY_MIB = 256 * 1024


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
