"""Resizing running nodes in place where the engine can, and saying which need a relaunch."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from dlrover.engines.base import Engine, EngineError, NodeSpec, ResizeUnsupportedError, Resources

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ResizeOutcome:
    """What became of a plan's nodes: resized in place (the same processes go on), or to be
    relaunched at the new size (the engine said why not in place)."""

    in_place: dict[str, NodeSpec]
    """Node id -> its spec with the new resources (the node id is unchanged)."""
    relaunch: dict[str, str]
    """Node id -> why it cannot be resized in place."""

    def describe(self) -> str:
        """``resized in place`` / ``relaunched (a: why)`` / both, for the plan's record."""
        parts = []
        if self.in_place:
            every = not self.relaunch
            parts.append(
                "resized in place" if every else f"resized in place ({', '.join(self.in_place)})"
            )
        if self.relaunch:
            nodes: dict[str, list[str]] = {}
            for node, reason in self.relaunch.items():
                nodes.setdefault(reason, []).append(node)
            why = "; ".join(f"{', '.join(ids)}: {reason}" for reason, ids in nodes.items())
            parts.append(f"relaunched ({why})")
        return "; ".join(parts)


def resize_in_place(
    engine: Engine, specs: Sequence[NodeSpec], resources: Resources
) -> ResizeOutcome:
    """Ask ``engine`` to give each node of ``specs`` ``resources`` without a restart; the nodes
    it cannot resize (ResizeUnsupportedError, or any engine error) are named with the reason,
    for the caller to relaunch."""
    in_place: dict[str, NodeSpec] = {}
    relaunch: dict[str, str] = {}
    for spec in specs:
        if spec.resources == resources:
            in_place[spec.node_id] = spec
            continue
        try:
            engine.resize(spec.node_id, resources)
        except ResizeUnsupportedError as e:
            relaunch[spec.node_id] = str(e)
            continue
        except EngineError as e:
            logger.warning("node %s could not be resized in place: %s", spec.node_id, e)
            relaunch[spec.node_id] = f"{type(e).__name__}: {e}"
            continue
        in_place[spec.node_id] = dataclasses.replace(spec, resources=resources)
    return ResizeOutcome(in_place, relaunch)
