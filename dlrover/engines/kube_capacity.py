"""What a Kubernetes cluster can still schedule: allocatable minus requests, per machine.

Pure functions over the API's node and pod objects (plain dicts), so they are tested without a
cluster; the engine lists nodes and pods and calls `free_capacity`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from dlrover.engines.base import Capacity

_QUANTITY = re.compile(r"^([0-9.]+(?:[eE][-+]?[0-9]+)?)([a-zA-Z]*)$")
_SUFFIX = {
    "": 1.0,
    "m": 1e-3,
    "k": 1e3,
    "M": 1e6,
    "G": 1e9,
    "T": 1e12,
    "P": 1e15,
    "Ki": 1024.0,
    "Mi": 1024.0**2,
    "Gi": 1024.0**3,
    "Ti": 1024.0**4,
    "Pi": 1024.0**5,
}


def quantity(value: str | int | float) -> float:
    """A Kubernetes resource quantity as a number: ``"500m"`` -> 0.5, ``"2Gi"`` -> 2147483648."""
    if isinstance(value, (int, float)):
        return float(value)
    match = _QUANTITY.match(value.strip())
    if match is None or match.group(2) not in _SUFFIX:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return float(match.group(1)) * _SUFFIX[match.group(2)]


def _schedulable(node: Mapping[str, Any]) -> bool:
    if node.get("spec", {}).get("unschedulable"):
        return False
    conditions = node.get("status", {}).get("conditions", [])
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _requests(pod: Mapping[str, Any]) -> tuple[float, float]:
    """CPU cores and memory bytes the pod's containers request (init containers: the largest)."""
    spec = pod.get("spec", {})
    cpu = mem = 0.0
    for c in spec.get("containers", []):
        req = (c.get("resources") or {}).get("requests") or {}
        cpu += quantity(req.get("cpu", 0))
        mem += quantity(req.get("memory", 0))
    for c in spec.get("initContainers", []):
        req = (c.get("resources") or {}).get("requests") or {}
        cpu = max(cpu, quantity(req.get("cpu", 0)))
        mem = max(mem, quantity(req.get("memory", 0)))
    return cpu, mem


def free_capacity(
    nodes: Iterable[Mapping[str, Any]], pods: Iterable[Mapping[str, Any]]
) -> Capacity:
    """The most one more pod can get: the schedulable, ready machine with the most free memory,
    its allocatable CPU and memory less the requests of the pods bound to it that still run."""
    used: dict[str, tuple[float, float]] = {}
    for pod in pods:
        machine = pod.get("spec", {}).get("nodeName")
        if not machine or pod.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            continue
        cpu, mem = _requests(pod)
        had = used.get(machine, (0.0, 0.0))
        used[machine] = (had[0] + cpu, had[1] + mem)
    best: tuple[float, float] | None = None
    for node in nodes:
        if not _schedulable(node):
            continue
        alloc = node.get("status", {}).get("allocatable", {})
        taken = used.get(node["metadata"]["name"], (0.0, 0.0))
        free = (
            quantity(alloc.get("cpu", 0)) - taken[0],
            quantity(alloc.get("memory", 0)) - taken[1],
        )
        if best is None or free[1] > best[1]:
            best = free
    if best is None:
        return Capacity(0.0, 0)
    return Capacity(max(0.0, round(best[0], 3)), max(0, int(best[1]) >> 20))
