"""Kubernetes quantities and free capacity, from plain API objects."""

from __future__ import annotations

import pytest

from dlrover.engines.base import Capacity
from dlrover.engines.kube_capacity import free_capacity, quantity


@pytest.mark.parametrize(
    ("text", "value"),
    [("500m", 0.5), ("2", 2.0), ("1Gi", 1 << 30), ("16309872Ki", 16309872 * 1024), ("1e3", 1e3)],
)
def test_quantities(text: str, value: float) -> None:
    assert quantity(text) == value


def test_a_bad_quantity_is_refused() -> None:
    with pytest.raises(ValueError, match="not a Kubernetes quantity: '3 cores'"):
        quantity("3 cores")


def _machine(name: str, cpu: str, memory: str) -> dict[str, object]:
    return {
        "metadata": {"name": name},
        "status": {
            "allocatable": {"cpu": cpu, "memory": memory},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


def _pod(machine: str, cpu: str, memory: str, phase: str = "Running") -> dict[str, object]:
    req = {"requests": {"cpu": cpu, "memory": memory}}
    return {
        "spec": {"nodeName": machine, "containers": [{"resources": req}, {"resources": {}}]},
        "status": {"phase": phase},
    }


def test_free_capacity_counts_requests_of_live_pods_on_each_machine() -> None:
    machines = [_machine("a", "8", "32Gi"), _machine("b", "16", "16Gi")]
    pods = [
        _pod("a", "2", "20Gi"),
        _pod("a", "1", "1Gi", phase="Failed"),  # ended: holds nothing
        _pod("b", "500m", "2Gi"),
        {"spec": {"containers": []}, "status": {"phase": "Pending"}},  # not bound yet
    ]
    assert free_capacity(machines, pods) == Capacity(15.5, 14 * 1024)  # b has the most memory
    assert free_capacity([], pods) == Capacity(0.0, 0)  # no machine: nothing fits
