"""An in-memory engine for policy and controller tests: records calls, lets a test emit events."""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable

from dlrover.engines.base import (
    Engine,
    EventQueue,
    FailureReason,
    LaunchError,
    Node,
    NodeEvent,
    NodeNotFoundError,
    NodeSpec,
    NodeState,
    RateLimitedError,
    ResizeUnsupportedError,
    Resources,
)
from dlrover.master.launch_queue import TokenBucket


class FakeEngine(Engine):
    """Runs nothing. `launched` and `deleted` record every call in order; `emit` / `fail` /
    `succeed` inject lifecycle events as a real engine would report them.

    `fail_launch_of` makes launches of those node ids raise LaunchError (for partial-batch tests).
    `launch_barrier`, when set, makes every launch wait on it, so a test can prove launches
    overlap (a batch of N only passes an N-party barrier if all N run at once).
    `resizable` makes `resize` succeed for running and pending nodes (recorded in `resized`);
    otherwise it answers as an engine that cannot resize.

    As Kubernetes would (the scale tests' stand-in): ``launch_rate`` creations a second at most
    (a token bucket of one second's worth; a launch past it raises RateLimitedError, as an API
    server's 429, counted in ``refused``); ``launch_latency`` (low, high) seconds: each launched
    node reports RUNNING after a uniformly random latency (``on_running(spec)`` is called
    first, where the test starts what the pod would run). ``accepted_at`` records when each
    launch was accepted.
    """

    def __init__(
        self,
        launch_rate: float | None = None,
        launch_latency: tuple[float, float] | None = None,
        on_running: Callable[[NodeSpec], None] | None = None,
        seed: int = 0,
    ) -> None:
        self.launch_rate = launch_rate
        self.launch_latency = launch_latency
        self.on_running = on_running
        self.refused = 0
        self.accepted_at: list[float] = []
        self._random = random.Random(seed)
        self.bucket = None if launch_rate is None else TokenBucket(launch_rate)
        """The API's creations left this second (None: no limit)."""
        self.launched: list[NodeSpec] = []
        self.deleted: list[str] = []
        self.fail_launch_of: set[str] = set()
        self.launch_barrier: threading.Barrier | None = None
        self.resizable = False
        self.resized: list[tuple[str, Resources]] = []
        self.closed = False
        self._nodes: dict[str, Node] = {}
        self._queue = EventQueue()
        self._lock = threading.Lock()

    def launch(self, spec: NodeSpec) -> Node:
        """Record ``spec`` and queue its PENDING event; the node stays PENDING until the test emits
        more. Waits on ``launch_barrier`` (10 s) if set; raises LaunchError for ids in
        ``fail_launch_of``; an id already launched returns that node, not recorded again."""
        if self.launch_barrier is not None:
            self.launch_barrier.wait(timeout=10)
        if spec.node_id in self.fail_launch_of:
            raise LaunchError(f"{spec.node_id}: refused by the test")
        with self._lock:
            existing = self._nodes.get(spec.node_id)
            if existing is not None:
                return dataclasses.replace(existing)
            if self.bucket is not None:
                if self.bucket.available() < 1:
                    self.refused += 1
                    raise RateLimitedError(
                        f"{spec.node_id}: 429 Too Many Requests ({self.bucket.rate:g}/s)",
                        retry_after_s=1 / self.bucket.rate,
                    )
                self.bucket.take(1)
            node = Node(spec=spec)
            self._nodes[spec.node_id] = node
            self.launched.append(spec)
            self.accepted_at.append(time.monotonic())
            latency = (
                None if self.launch_latency is None else self._random.uniform(*self.launch_latency)
            )
        self._queue.put(NodeEvent(spec.node_id, spec, NodeState.PENDING))
        if latency is not None:
            timer = threading.Timer(latency, self._came_up, (spec,))
            timer.daemon = True
            timer.start()
        return dataclasses.replace(node)

    def adopt(self, spec: NodeSpec) -> None:
        """A node that runs already (launched before this engine was made, as pods a restarted
        master finds): RUNNING, not recorded in ``launched``, no rate spent."""
        with self._lock:
            self._nodes[spec.node_id] = Node(spec=spec, state=NodeState.RUNNING)

    def _came_up(self, spec: NodeSpec) -> None:
        with self._lock:
            if self._nodes[spec.node_id].state is not NodeState.PENDING:
                return  # deleted or failed meanwhile
        if self.on_running is not None:
            self.on_running(spec)
        self.run(spec.node_id)

    def delete(self, node_id: str) -> None:
        """Record the call (even for a node that already ended), then emit DELETED unless the node
        ended; NodeNotFoundError for an unknown id."""
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                raise NodeNotFoundError(node_id)
            self.deleted.append(node_id)
            if node.state.is_final:
                return
        self.emit(node_id, NodeState.DELETED)

    def resize(self, node_id: str, resources: Resources) -> Node:
        """With ``resizable``, record the call and give the node ``resources``; otherwise (or
        for a node that ended) ResizeUnsupportedError. NodeNotFoundError for an unknown id."""
        if not self.resizable:
            return super().resize(node_id, resources)
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                raise NodeNotFoundError(node_id)
            if node.state.is_final:
                raise ResizeUnsupportedError(f"node {node_id} ended ({node.state.value})")
            node.spec = dataclasses.replace(node.spec, resources=resources)
            self.resized.append((node_id, resources))
            return dataclasses.replace(node)

    def list_nodes(self) -> list[Node]:
        """Copies of every launched node, in the state the test last emitted."""
        with self._lock:
            return [dataclasses.replace(node) for node in self._nodes.values()]

    def events(self, timeout: float) -> list[NodeEvent]:
        """Queued events, waiting up to ``timeout`` seconds for the first."""
        return self._queue.drain(timeout)

    def close(self, delete_nodes: bool = True) -> None:
        """With ``delete_nodes``, delete every node (each recorded in ``deleted``); then set
        ``closed``. Launches are not refused afterwards."""
        if delete_nodes:
            for node in self.list_nodes():
                self.delete(node.node_id)
        self.closed = True

    # --- what a test drives -----------------------------------------------------------------
    def emit(
        self,
        node_id: str,
        state: NodeState,
        reason: FailureReason | None = None,
        exit_code: int | None = None,
        signal: int | None = None,
        message: str = "",
    ) -> NodeEvent:
        """Set the node's state and queue the event, as a real engine would report it; no transition
        is checked. NodeNotFoundError for an unknown id."""
        with self._lock:
            node = self._nodes.get(node_id)
            if node is None:
                raise NodeNotFoundError(node_id)
            node.state = state
        event = NodeEvent(node_id, node.spec, state, reason, exit_code, signal, message)
        self._queue.put(event)
        return event

    def run(self, node_id: str) -> NodeEvent:
        """Emit RUNNING for ``node_id``."""
        return self.emit(node_id, NodeState.RUNNING)

    def succeed(self, node_id: str) -> NodeEvent:
        """Emit SUCCEEDED for ``node_id``."""
        return self.emit(node_id, NodeState.SUCCEEDED)

    def fail(
        self,
        node_id: str,
        reason: FailureReason = FailureReason.EXIT_CODE,
        exit_code: int | None = 1,
        message: str = "",
    ) -> NodeEvent:
        """Emit FAILED with ``reason``; ``exit_code`` is kept only for an EXIT_CODE failure."""
        return self.emit(
            node_id,
            NodeState.FAILED,
            reason,
            exit_code if reason is FailureReason.EXIT_CODE else None,
            message=message,
        )
