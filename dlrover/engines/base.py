"""The engine contract: node blueprints, running nodes, lifecycle events, the Engine interface."""

from __future__ import annotations

import abc
import dataclasses
import enum
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from dlrover.engines.node_logs import NodeLogs

ROLES = ("worker", "ps", "chief", "evaluator")
"""Node roles a job is made of; only `worker` is driven today, the others come with PS jobs."""

DEFAULT_LAUNCH_PARALLELISM = 32
"""How many launches `Engine.launch_many` runs at once."""

# Node ids become Kubernetes pod names and Ray actor names, so they follow DNS-1123 label rules.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class EngineError(Exception):
    """Base of every error an engine raises."""


class InvalidNodeSpecError(EngineError, ValueError):
    """A NodeSpec that no engine can run (bad name, negative resources, empty command)."""


class NodeNotFoundError(EngineError, KeyError):
    """The engine has never launched a node with this id."""


class LaunchError(EngineError):
    """The engine could not create the node (API refused, no capacity before the deadline)."""


class RateLimitedError(LaunchError):
    """The engine's API refused a launch for now (Kubernetes: 429 Too Many Requests, or its
    client's own rate limit): the same launch may succeed after ``retry_after_s``."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ResizeUnsupportedError(EngineError):
    """A running node's resources cannot be changed in place (this engine cannot, the node ended,
    or the new size is below what it uses): relaunch it at the new size instead."""


class LaunchManyError(EngineError):
    """Some launches of a batch failed; the others are running and listed in `launched`."""

    def __init__(self, launched: list[Node], failures: dict[str, EngineError]) -> None:
        self.launched = launched
        self.failures = failures
        details = "; ".join(f"{node_id}: {error}" for node_id, error in failures.items())
        super().__init__(
            f"{len(failures)} of {len(launched) + len(failures)} launches failed: {details}"
        )


@dataclasses.dataclass(frozen=True)
class Resources:
    """What one node asks for. Zero means "no request" (the engine's default applies)."""

    cpu: float = 0.0
    """Cores (fractions allowed)."""
    memory_mib: int = 0
    """Memory limit in MiB; the OOM relaunch policy raises it."""
    gpu: int = 0
    """Whole accelerators."""
    shm_mib: int = 0
    """Size of /dev/shm for flash checkpoint; 0: the engine picks (Kubernetes: half of memory)."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value < 0:
                raise InvalidNodeSpecError(
                    f"resources.{field.name} is {value}; it must be >= 0 (0 means no request)"
                )


class NodeState(enum.Enum):
    """Lifecycle of a node. Legal transitions:
    PENDING -> RUNNING | SUCCEEDED | FAILED | DELETED;
    RUNNING -> SUCCEEDED | FAILED | DELETED.
    SUCCEEDED, FAILED and DELETED are final: a replacement is a new node (relaunch_count + 1).
    """

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DELETED = "deleted"
    """Removed on request of the engine's owner; not a failure, never relaunched by policy."""

    @property
    def is_final(self) -> bool:
        """True for SUCCEEDED, FAILED and DELETED: the node never changes state again."""
        return self in (NodeState.SUCCEEDED, NodeState.FAILED, NodeState.DELETED)


class FailureReason(enum.Enum):
    """Why a node failed; the relaunch and OOM policies decide on this, never on engine details."""

    EXIT_CODE = "exit_code"
    """The node's command exited with a non-zero code (see NodeEvent.exit_code)."""
    SIGNAL = "signal"
    """The node's command was killed by a signal (see NodeEvent.signal)."""
    OOM_KILLED = "oom_killed"
    """The kernel or the engine killed it for exceeding its memory."""
    NODE_LOST = "node_lost"
    """The machine / Ray node / pod running it vanished (or was deleted by someone else)."""
    PREEMPTED = "preempted"
    """The platform evicted it (spot reclaim, eviction, disruption)."""
    LAUNCH_FAILED = "launch_failed"
    """It never started: no capacity before the deadline, image missing, command not found."""
    UNKNOWN = "unknown"


@dataclasses.dataclass(frozen=True)
class NodeSpec:
    """The blueprint of one node: which job, which slot (role, rank), which attempt, what to run.

    Invariant: `node_id` is a pure function of (job_name, role, rank, relaunch_count), so a launch
    retried after a lost reply is idempotent and a replacement never collides with its predecessor.
    """

    job_name: str
    """Job the node belongs to (DNS-1123 label: lowercase letters, digits, '-')."""
    rank: int
    """Node rank within its role; a replacement keeps the rank of the node it replaces."""
    command: tuple[str, ...]
    """argv of the node's agent, e.g. ("dlrover-run", "--nnodes=2:4", "train.py")."""
    role: str = "worker"
    """One of ROLES."""
    relaunch_count: int = 0
    """0 for the first node of this slot, +1 for each replacement."""
    resources: Resources = dataclasses.field(default_factory=Resources)
    # Left out of the hash (a dict is not hashable); still compared for equality.
    env: Mapping[str, str] = dataclasses.field(default_factory=dict, hash=False)
    """Extra environment (DLROVER_MASTER_ADDR, DLROVER_JOB_TOKEN, ...) on top of the engine's."""
    resizable: bool = False
    """The master may size this node in place later (an auto-scaled job): the local engine gives
    it a cgroup of its own even when it asks for no resources. Without it an unsized node runs
    in the engine's cgroup, its processes sharing the CPU one by one with everything else on
    the machine (a cgroup per node would share it node by node instead)."""

    def __post_init__(self) -> None:
        if not _DNS_LABEL.match(self.job_name) or len(self.job_name) > 40:
            raise InvalidNodeSpecError(
                f"job name {self.job_name!r} must be 1-40 lowercase letters, digits or '-', "
                "starting and ending with a letter or digit (it becomes pod and actor names)"
            )
        if self.role not in ROLES:
            raise InvalidNodeSpecError(f"role {self.role!r} is not one of {', '.join(ROLES)}")
        if self.rank < 0 or self.relaunch_count < 0:
            raise InvalidNodeSpecError(
                f"rank ({self.rank}) and relaunch_count ({self.relaunch_count}) must be >= 0"
            )
        if not self.command or not all(isinstance(arg, str) for arg in self.command):
            raise InvalidNodeSpecError("command must be a non-empty sequence of strings (argv)")
        # Accept lists from callers but keep the frozen spec hashable and immutable.
        object.__setattr__(self, "command", tuple(self.command))
        object.__setattr__(self, "env", dict(self.env))

    @property
    def node_id(self) -> str:
        """``<job>-<role>-<rank>-<relaunch_count>``: one per attempt at a slot, the same for a
        retried launch (it names the pod or actor)."""
        return f"{self.job_name}-{self.role}-{self.rank}-{self.relaunch_count}"

    def replacement(self, resources: Resources | None = None) -> NodeSpec:
        """The spec of the node that replaces this one: same slot, next attempt."""
        return dataclasses.replace(
            self, relaunch_count=self.relaunch_count + 1, resources=resources or self.resources
        )


@dataclasses.dataclass
class Node:
    """A node the engine created: its spec, its last known state, and where it runs."""

    spec: NodeSpec
    state: NodeState = NodeState.PENDING
    host: str = ""
    """Where it runs: hostname, Ray node id or Kubernetes node name ("" while pending)."""

    @property
    def node_id(self) -> str:
        """The id of the node's spec."""
        return self.spec.node_id


@dataclasses.dataclass(frozen=True)
class NodeEvent:
    """One lifecycle transition of one node, as reported by an engine."""

    node_id: str
    spec: NodeSpec
    state: NodeState
    reason: FailureReason | None = None
    """Set when state is FAILED."""
    exit_code: int | None = None
    signal: int | None = None
    message: str = ""
    host: str = ""
    timestamp: float = dataclasses.field(default_factory=time.time)

    def outcome(self) -> str:
        """The new state and, for a failure, why: ``failed (exit_code: exited with code 1)``."""
        why = f" ({self.reason.value}: {self.message})" if self.reason else ""
        return f"{self.state.value}{why}"

    def __str__(self) -> str:
        return f"{self.node_id} -> {self.outcome()}"


class EventQueue:
    """Thread-safe queue of NodeEvents; `drain` waits (with a deadline) for the first one."""

    def __init__(self) -> None:
        self._events: deque[NodeEvent] = deque()
        self._cond = threading.Condition()

    def put(self, event: NodeEvent) -> None:
        """Queue ``event`` and wake a waiting ``drain``."""
        with self._cond:
            self._events.append(event)
            self._cond.notify_all()

    def drain(self, timeout: float) -> list[NodeEvent]:
        """Every queued event, waiting up to ``timeout`` seconds for the first; empty at the
        deadline."""
        deadline = time.monotonic() + max(timeout, 0.0)
        with self._cond:
            while not self._events:
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._cond.wait(left)
            events = list(self._events)
            self._events.clear()
            return events


_EngineT = TypeVar("_EngineT", bound="Engine")


@dataclasses.dataclass(frozen=True)
class Capacity:
    """What an engine can still launch; None: unknown (taken as enough)."""

    cpu: float | None = None
    memory_mib: int | None = None

    def fits(self, size: Resources) -> bool:
        """Whether one more node of ``size`` fits."""
        cpu_ok = self.cpu is None or not size.cpu or size.cpu <= self.cpu
        mem_ok = (
            self.memory_mib is None or not size.memory_mib or size.memory_mib <= self.memory_mib
        )
        return cpu_ok and mem_ok

    def describe(self) -> str:
        """``8 CPU, 30720 MiB free`` (``unknown`` parts say so)."""
        cpu = "? CPU" if self.cpu is None else f"{self.cpu:g} CPU"
        mem = "? MiB" if self.memory_mib is None else f"{self.memory_mib} MiB"
        return f"{cpu}, {mem} free"


class Engine(abc.ABC):
    """Where nodes run. The master's controller drives it; policies never see which one it is.

    Contract:
    - `launch` returns once the node is created (it may still be PENDING); lifecycle changes then
      arrive through `events`. Launching a node id that already exists returns the existing node.
    - `delete` is idempotent: deleting a node that already ended is not an error; the node's
      final event is DELETED, so the policy does not relaunch it.
    - Every node that ends produces exactly one final event (SUCCEEDED, FAILED or DELETED).
    - `close` stops the engine's watchers; `close(delete_nodes=True)` also removes every node
      (SIGTERM, grace, SIGKILL where the engine owns processes).
    - `resize` changes a running node's resources without restarting it, or raises
      ResizeUnsupportedError and changes nothing (the caller relaunches the node instead).
    - `launch_rate`: launches per second the engine's API takes (None: no limit). The master
      hands launches over no faster (`dlrover.master.launch_queue`); a launch refused for now
      anyway raises RateLimitedError and is handed over again later.
    """

    launch_rate: float | None = None

    @abc.abstractmethod
    def launch(self, spec: NodeSpec) -> Node:
        """Create the node described by `spec`."""

    @abc.abstractmethod
    def delete(self, node_id: str) -> None:
        """Remove a node; raises NodeNotFoundError only for an id this engine never launched."""

    @abc.abstractmethod
    def list_nodes(self) -> list[Node]:
        """Snapshot of every node this engine launched and has not forgotten."""

    @abc.abstractmethod
    def events(self, timeout: float) -> list[NodeEvent]:
        """Wait up to `timeout` seconds for the first event, then return all that are queued."""

    @abc.abstractmethod
    def close(self, delete_nodes: bool = True) -> None:
        """Stop watching; with `delete_nodes`, remove every node first."""

    def resize(self, node_id: str, resources: Resources) -> Node:
        """Give the running node ``resources`` in place (no restart, same node id); returns the
        node with its new spec. Raises NodeNotFoundError for an id never launched, and
        ResizeUnsupportedError where it cannot be done in place (the default: this engine never
        can), leaving the node as it was."""
        raise ResizeUnsupportedError(f"the {type(self).__name__} cannot resize a running node")

    def capacity(self) -> Capacity:
        """What this engine can still launch now (default: unknown)."""
        return Capacity()

    def logs(self) -> NodeLogs | None:
        """Where the nodes' logs (agents' and per-rank) can be read back, or None where this
        engine keeps none readable from the master."""
        return None

    def launch_many(
        self, specs: Sequence[NodeSpec], parallelism: int = DEFAULT_LAUNCH_PARALLELISM
    ) -> list[Node]:
        """Launch a batch concurrently (30 failed nodes are replaced at once, not one by one).

        Returns the nodes in the order of `specs`; if any launch fails, the others still happen
        and LaunchManyError lists both the launched nodes and each failure.
        """
        if not specs:
            return []
        results: dict[str, Node] = {}
        failures: dict[str, EngineError] = {}
        with ThreadPoolExecutor(
            max_workers=min(parallelism, len(specs)), thread_name_prefix="engine-launch"
        ) as pool:
            futures = {spec.node_id: pool.submit(self.launch, spec) for spec in specs}
            for node_id, future in futures.items():
                error = future.exception()
                if error is None:
                    results[node_id] = future.result()
                elif isinstance(error, EngineError):
                    failures[node_id] = error
                else:
                    failures[node_id] = LaunchError(f"{type(error).__name__}: {error}")
        launched = [results[spec.node_id] for spec in specs if spec.node_id in results]
        if failures:
            raise LaunchManyError(launched, failures)
        return launched

    def delete_many(
        self, node_ids: Sequence[str], parallelism: int = DEFAULT_LAUNCH_PARALLELISM
    ) -> None:
        """Delete a batch concurrently (each delete may wait out a grace period).
        Raises the first error after every delete has been attempted."""
        if not node_ids:
            return
        with ThreadPoolExecutor(
            max_workers=min(parallelism, len(node_ids)), thread_name_prefix="engine-delete"
        ) as pool:
            futures = [pool.submit(self.delete, node_id) for node_id in node_ids]
            errors = [error for error in (f.exception() for f in futures) if error is not None]
        if errors:
            raise errors[0]

    def __enter__(self: _EngineT) -> _EngineT:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def wait_for_event(
    engine: Engine,
    matches: Callable[[NodeEvent], bool],
    timeout: float,
    seen: list[NodeEvent] | None = None,
) -> NodeEvent:
    """Drain `engine.events` until one matches and return it; every drained event (including
    those after the match in the same batch) is appended to `seen`, so none is lost.

    Raises EngineError naming what it saw when `timeout` passes first.
    """
    seen = [] if seen is None else seen
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise EngineError(
                f"no matching node event within {timeout:.1f}s "
                f"(saw: {', '.join(map(str, seen)) or 'nothing'})"
            )
        batch = engine.events(min(left, 1.0))
        seen.extend(batch)
        for event in batch:
            if matches(event):
                return event
