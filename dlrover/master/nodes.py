"""The master's node table: every agent that registered, its state, liveness and progress."""

from __future__ import annotations

import enum
import heapq
import json
import logging
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from dlrover.api.master import HeartbeatReport
from dlrover.master.state_store import StateStore

logger = logging.getLogger(__name__)

_NAMESPACE = "nodes"


class NodeState(str, enum.Enum):
    """Lifecycle of a node as the master sees it.

    Legal transitions:
      PENDING -> RUNNING      (the node is a member of a completed rendezvous round)
      RUNNING -> PENDING      (it joins a new round: restart, membership change)
      PENDING|RUNNING -> SUCCEEDED | FAILED   (its agent reported the end)
      PENDING|RUNNING -> LOST (no heartbeat within the timeout)
      LOST|SUCCEEDED|FAILED -> PENDING  (the agent registers again)
    """

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    LOST = "lost"


_LEGAL: dict[NodeState, set[NodeState]] = {
    NodeState.PENDING: {NodeState.RUNNING, NodeState.SUCCEEDED, NodeState.FAILED, NodeState.LOST},
    NodeState.RUNNING: {NodeState.PENDING, NodeState.SUCCEEDED, NodeState.FAILED, NodeState.LOST},
    NodeState.LOST: {NodeState.PENDING},
    NodeState.SUCCEEDED: {NodeState.PENDING},
    NodeState.FAILED: {NodeState.PENDING},
}

ALIVE_STATES = frozenset({NodeState.PENDING, NodeState.RUNNING})


class NodeError(Exception):
    """A request named a node the master does not know, or a stale incarnation of it."""


class UnknownNodeError(NodeError):
    """No node has this id: the agent must register (again)."""


@dataclass
class Node:
    """One agent (one machine, or one simulated machine) in the job."""

    node_id: str
    host: str
    role: str
    local_world_size: int
    requested_rank: int
    order: int
    """Registration order; ties in rank assignment are broken by it so ranks stay stable."""
    incarnation: int = 1
    state: NodeState = NodeState.PENDING
    node_rank: int = -1
    step: int = -1
    restart_count: int = 0
    cpu_percent: float = 0.0
    memory_bytes: int = 0
    exit_code: int = 0
    reason: str = ""
    pid: int = 0
    """The agent's process id as it registered."""
    worker_pids: tuple[int, ...] = ()
    """Its workers' process ids by local rank, from its heartbeats."""
    last_heartbeat: float = field(default=0.0)
    """Monotonic time of the last sign of life; not persisted (a restarted master re-arms it)."""
    step_at: float = field(default=0.0)
    """Monotonic time ``step`` was last raised (the auto-scaler's step rate); not persisted."""
    breakdown: tuple[float, float, float] = field(default=(0.0, 0.0, 0.0))
    """Wall seconds per step lately and its data-wait and checkpoint parts; not persisted."""
    persist_s: float = field(default=0.0)
    """How long its latest flash-checkpoint persist took; not persisted."""
    samples_per_s: float = field(default=0.0)
    """Its workers' samples per second lately, as reported; not persisted."""

    def to_json(self) -> dict[str, object]:
        """The node as a JSON-able dict for the state store, without the fields that are not
        persisted (`_NOT_PERSISTED`). Flat fields copied by name: ``dataclasses.asdict`` (a
        deep copy of each) made persisting a 3,000-node round's members take 0.7 s."""
        d = {name: getattr(self, name) for name in _PERSISTED}
        d["state"] = self.state.value
        d["worker_pids"] = list(self.worker_pids)
        return d

    @classmethod
    def from_json(cls, d: dict[str, object]) -> Node:
        """Rebuild a node from ``to_json()``; ``last_heartbeat`` starts at 0 (the caller re-arms
        it)."""
        d = dict(d)
        d["state"] = NodeState(d["state"])
        d["worker_pids"] = tuple(d.get("worker_pids") or ())  # type: ignore[arg-type]
        return cls(**d)  # type: ignore[arg-type]


_NOT_PERSISTED = frozenset({"last_heartbeat", "step_at", "breakdown", "persist_s", "samples_per_s"})
_PERSISTED = tuple(f.name for f in fields(Node) if f.name not in _NOT_PERSISTED)


def _copy(node: Node) -> Node:
    """A shallow copy of ``node``, as ``dataclasses.replace(node)`` makes it (every field of
    Node is an ``__init__`` field, and it has no ``__post_init__``) at a fifth of its cost."""
    copy = object.__new__(Node)
    copy.__dict__.update(node.__dict__)
    return copy


def _rank_order(node: Node) -> tuple[bool, int, str]:
    return (node.node_rank < 0, node.node_rank, node.node_id)


class NodeTable:
    """All nodes of the job, persisted through the StateStore on every change.

    Thread-safe. Every state change is logged as `node <id>: old -> new (reason)`.
    """

    def __init__(self, store: StateStore, clock: Callable[[], float]) -> None:
        self._store = store
        self._clock = clock
        self._lock = threading.RLock()
        self._nodes: dict[str, Node] = {}
        self._counts: Counter[NodeState] = Counter()
        """Nodes per state, kept with every transition: the hot paths never scan the table."""
        for key, raw in store.items(_NAMESPACE).items():
            node = Node.from_json(json.loads(raw))
            node.last_heartbeat = clock()
            self._nodes[key] = node
            self._counts[node.state] += 1

    def count(self, *states: NodeState) -> int:
        """How many nodes are in any of ``states`` (O(1))."""
        with self._lock:
            return sum(self._counts[s] for s in states)

    def __len__(self) -> int:
        with self._lock:
            return len(self._nodes)

    def register(
        self,
        node_id: str,
        host: str,
        role: str,
        local_world_size: int,
        requested_rank: int,
        pid: int,
    ) -> Node:
        """Add a new node, or re-admit a known one with a bumped incarnation."""
        with self._lock:
            known = self._nodes.get(node_id) if node_id else None
            if known is None:
                node_id = node_id or uuid.uuid4().hex[:12]
                node = Node(
                    node_id=node_id,
                    host=host,
                    role=role,
                    local_world_size=local_world_size,
                    requested_rank=requested_rank,
                    order=len(self._nodes),
                    pid=pid,
                    last_heartbeat=self._clock(),
                )
                self._nodes[node_id] = node
                self._counts[node.state] += 1
                logger.info("node %s: registered from %s (pid %d)", node_id, host, pid)
            else:
                node = known
                node.incarnation += 1
                node.host, node.pid = host, pid
                node.local_world_size = local_world_size
                node.last_heartbeat = self._clock()
                if node.state != NodeState.PENDING:
                    self._transition(node, NodeState.PENDING, "registered again")
                logger.info("node %s: registered again, incarnation %d", node_id, node.incarnation)
            self._persist(node)
            return node

    def get(self, node_id: str, incarnation: int | None = None) -> Node:
        """The node itself (not a copy). Raises UnknownNodeError for an unknown id, and NodeError
        when ``incarnation`` is given, non-zero and not the current one."""
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                raise UnknownNodeError(f"unknown node {node_id!r}: register it first")
            if incarnation is not None and incarnation and incarnation != node.incarnation:
                raise NodeError(
                    f"node {node_id!r} incarnation {incarnation} is stale "
                    f"(current {node.incarnation}): another agent took over this node id"
                )
            return node

    def all(self) -> list[Node]:
        """A snapshot: copies of every node, consistent with each other."""
        with self._lock:
            return [_copy(n) for n in self._nodes.values()]

    def first_alive(self, limit: int) -> list[Node]:
        """Copies of the first ``limit`` alive nodes in node-rank order (ranked ones first, the
        rest by id): what the job's charts show, without copying every node of a large job
        under the lock the heartbeats take (`all` at 20,000 nodes: about 15 ms)."""
        with self._lock:
            alive = (n for n in self._nodes.values() if n.state in ALIVE_STATES)
            return [_copy(n) for n in heapq.nsmallest(limit, alive, key=_rank_order)]

    def record_heartbeat(self, report: HeartbeatReport) -> NodeState:
        """A heartbeat of this incarnation: liveness, usage and progress, and its workers' pids
        (an empty tuple: between attempts); returns its state."""
        with self._lock:
            node = self.get(report.node_id, report.incarnation)
            node.last_heartbeat = self._clock()
            node.cpu_percent, node.memory_bytes = report.cpu_percent, report.memory_bytes
            node.restart_count = report.restart_count
            if report.step_wall_s > 0:
                node.breakdown = (report.step_wall_s, report.step_data_s, report.step_checkpoint_s)
                node.samples_per_s = report.samples_per_s
            if report.checkpoint_persist_s > 0:
                node.persist_s = report.checkpoint_persist_s
            if report.step > node.step:
                node.step, node.step_at = report.step, node.last_heartbeat
            if tuple(report.worker_pids) != node.worker_pids:
                # Persisted (they change once per attempt): an ended job's table still names them.
                node.worker_pids = tuple(report.worker_pids)
                self._persist(node)
            return node.state

    def record_step(self, node_id: str, step: int) -> None:
        """A training process of the node finished ``step`` (a sign of life too)."""
        with self._lock:
            node = self.get(node_id)
            node.last_heartbeat = self._clock()
            if step > node.step:
                node.step, node.step_at = step, node.last_heartbeat

    def activate(self, ranks: dict[str, int], reason: str) -> None:
        """The members of a round that closed, with their node ranks: each recorded and a
        PENDING one made RUNNING, logged with ``reason``; the changed nodes persisted in one
        write."""
        changed: dict[str, Node] = {}
        with self._lock:
            for node_id, node_rank in ranks.items():
                node = self.get(node_id)
                if node.node_rank != node_rank:
                    node.node_rank = node_rank
                    changed[node_id] = node
                if node.state == NodeState.PENDING:
                    self._transition(node, NodeState.RUNNING, reason)
                    changed[node_id] = node
            self._store.put_json_many(
                _NAMESPACE, {node_id: node.to_json() for node_id, node in changed.items()}
            )

    def set_exit_code(self, node_id: str, exit_code: int) -> None:
        """Record (and persist) the exit code of the node's failed workers."""
        with self._lock:
            node = self.get(node_id)
            node.exit_code = exit_code
            self._persist(node)

    def set_state(self, node_id: str, new: NodeState, reason: str) -> None:
        """Move the node to ``new``, logged with ``reason`` and persisted; nothing if it is already
        there. Raises NodeError for a transition NodeState does not allow."""
        with self._lock:
            node = self.get(node_id)
            if node.state == new:
                return
            self._transition(node, new, reason)
            self._persist(node)

    def touch(self, node_id: str) -> None:
        """A sign of life from the node: reset its heartbeat time. Raises UnknownNodeError."""
        with self._lock:
            self.get(node_id).last_heartbeat = self._clock()

    def expired(self, timeout_s: float) -> list[Node]:
        """Alive nodes whose last heartbeat is older than `timeout_s`."""
        now = self._clock()
        with self._lock:
            return [
                n
                for n in self._nodes.values()
                if n.state in ALIVE_STATES and now - n.last_heartbeat > timeout_s
            ]

    def _transition(self, node: Node, new: NodeState, reason: str) -> None:
        if new not in _LEGAL[node.state]:
            raise NodeError(
                f"node {node.node_id}: illegal transition {node.state.value} -> {new.value}"
            )
        logger.info("node %s: %s -> %s (%s)", node.node_id, node.state.value, new.value, reason)
        self._counts[node.state] -= 1
        self._counts[new] += 1
        node.state = new
        node.reason = reason

    def _persist(self, node: Node) -> None:
        self._store.put_json(_NAMESPACE, node.node_id, node.to_json())
