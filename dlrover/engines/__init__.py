"""Where nodes run: the Engine interface and its local, Ray and Kubernetes implementations."""

from dlrover.engines.base import (
    Engine,
    EngineError,
    FailureReason,
    InvalidNodeSpecError,
    LaunchError,
    LaunchManyError,
    Node,
    NodeEvent,
    NodeNotFoundError,
    NodeSpec,
    NodeState,
    ResizeUnsupportedError,
    Resources,
    wait_for_event,
)

__all__ = [
    "Engine",
    "EngineError",
    "FailureReason",
    "InvalidNodeSpecError",
    "LaunchError",
    "LaunchManyError",
    "Node",
    "NodeEvent",
    "NodeNotFoundError",
    "NodeSpec",
    "NodeState",
    "ResizeUnsupportedError",
    "Resources",
    "wait_for_event",
]
