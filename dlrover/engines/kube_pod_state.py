"""Maps a pod's status to a node state and failure reason (OOMKilled, exit codes, eviction)."""

from __future__ import annotations

import dataclasses
from typing import Any

from dlrover.engines.base import FailureReason, NodeState

# Waiting reasons after which the container will never start without a new spec.
_NEVER_STARTS = {
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
}
# Pod-level reasons the platform gives when it takes a node away.
_PREEMPTED = {"Evicted", "Preempting", "DeadlineExceeded", "Shutdown", "NodeShutdown", "Terminated"}
_LOST = {"NodeLost", "UnexpectedAdmissionError", "NodeAffinity"}
_SIGNAL_EXIT_BASE = 128
"""Container runtimes report death by signal N as exit code 128 + N."""


@dataclasses.dataclass(frozen=True)
class PodOutcome:
    """What a pod's status means for its node."""

    state: NodeState
    reason: FailureReason | None = None
    exit_code: int | None = None
    signal: int | None = None
    message: str = ""
    host: str = ""


def _terminated(pod: dict[str, Any]) -> dict[str, Any] | None:
    for status in pod.get("status", {}).get("containerStatuses") or []:
        state = status.get("state") or {}
        if "terminated" in state:
            return dict(state["terminated"])
        last = status.get("lastState") or {}
        if "terminated" in last:
            return dict(last["terminated"])
    return None


def _waiting_reason(pod: dict[str, Any]) -> str:
    for status in pod.get("status", {}).get("containerStatuses") or []:
        waiting = (status.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in _NEVER_STARTS:
            return f"{waiting['reason']}: {waiting.get('message', '')}".strip(": ")
    return ""


def _disrupted(pod: dict[str, Any]) -> str:
    for condition in pod.get("status", {}).get("conditions") or []:
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            return str(condition.get("reason") or "DisruptionTarget")
    return ""


def pod_outcome(pod: dict[str, Any]) -> PodOutcome | None:
    """The node state a pod's status implies; None when it says nothing new (phase Unknown)."""
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    host = str((pod.get("spec") or {}).get("nodeName") or "")
    if phase == "Pending":
        never = _waiting_reason(pod)
        if never:
            return PodOutcome(
                NodeState.FAILED, FailureReason.LAUNCH_FAILED, message=never, host=host
            )
        return PodOutcome(NodeState.PENDING, host=host)
    if phase == "Running":
        return PodOutcome(NodeState.RUNNING, host=host)
    if phase == "Succeeded":
        return PodOutcome(NodeState.SUCCEEDED, exit_code=0, host=host)
    if phase != "Failed":
        return None  # Unknown: the kubelet is unreachable; wait for a real answer
    pod_reason = str(status.get("reason") or "")
    message = str(status.get("message") or pod_reason)
    disruption = _disrupted(pod)
    terminated = _terminated(pod)
    if terminated is not None and terminated.get("reason") == "OOMKilled":
        return PodOutcome(
            NodeState.FAILED,
            FailureReason.OOM_KILLED,
            exit_code=terminated.get("exitCode"),
            message="OOMKilled",
            host=host,
        )
    if pod_reason in _PREEMPTED or disruption:
        return PodOutcome(
            NodeState.FAILED, FailureReason.PREEMPTED, message=disruption or message, host=host
        )
    if pod_reason in _LOST:
        return PodOutcome(NodeState.FAILED, FailureReason.NODE_LOST, message=message, host=host)
    if terminated is not None:
        code = int(terminated.get("exitCode", 1))
        detail = terminated.get("reason") or "Error"
        if code > _SIGNAL_EXIT_BASE:
            return PodOutcome(
                NodeState.FAILED,
                FailureReason.SIGNAL,
                exit_code=code,
                signal=code - _SIGNAL_EXIT_BASE,
                message=f"{detail}: killed by signal {code - _SIGNAL_EXIT_BASE}",
                host=host,
            )
        return PodOutcome(
            NodeState.FAILED,
            FailureReason.EXIT_CODE,
            exit_code=code,
            message=f"{detail}: exit code {code}",
            host=host,
        )
    return PodOutcome(NodeState.FAILED, FailureReason.UNKNOWN, message=message, host=host)
