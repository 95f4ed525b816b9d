"""Ray engine: each node is an actor in its own placement group, running the node command."""

from __future__ import annotations

import dataclasses
import logging
import signal
import threading
import time
from typing import Any

from dlrover.constants import DEFAULT_RAY_NAMESPACE as DEFAULT_RAY_NAMESPACE
from dlrover.constants import DEFAULT_STOP_GRACE_S
from dlrover.engines.base import (
    Capacity,
    Engine,
    EngineError,
    EventQueue,
    FailureReason,
    LaunchError,
    Node,
    NodeEvent,
    NodeNotFoundError,
    NodeSpec,
    NodeState,
)
from dlrover.engines.node_logs import LogChunk
from dlrover.engines.ray_runner import NodeRunner

log = logging.getLogger(__name__)

DEFAULT_LAUNCH_TIMEOUT_S = 120.0
"""How long a node may wait for a Ray node with its resources before it fails to launch."""
DEFAULT_POLL_INTERVAL_S = 0.2


@dataclasses.dataclass
class _RayNode:
    node: Node
    placement_group: Any
    actor: Any
    launched_at: float
    start_ref: Any = None
    wait_ref: Any = None
    ray_node_id: str = ""
    deleting: bool = False


class RayEngine(Engine):
    """Nodes are `NodeRunner` actors. Each gets a one-bundle placement group with the node's
    resources (CPU, GPU, memory) and strategy SPREAD, so Ray balances nodes over Ray nodes and a
    lost node's replacement lands wherever capacity is left. Actors are never restarted by Ray
    (max_restarts=0): replacing a node is the controller's decision, made on our events.

    Node actors and their placement groups are detached and named by node id, so they outlive
    the process that launched them: an engine of a restarted master (the master actor Ray
    restarted) that launches the same node id adopts the running actor instead of starting a
    second one. `close(delete_nodes=True)` removes them; nothing else does.

    Failure mapping: command exit -> EXIT_CODE / SIGNAL; actor died while its Ray node is dead ->
    NODE_LOST; actor died of memory pressure -> OOM_KILLED; other actor deaths -> NODE_LOST;
    no Ray node with the resources within `launch_timeout_s` -> LAUNCH_FAILED.
    """

    def __init__(
        self,
        address: str | None = None,
        namespace: str = DEFAULT_RAY_NAMESPACE,
        launch_timeout_s: float = DEFAULT_LAUNCH_TIMEOUT_S,
        stop_grace_s: float = DEFAULT_STOP_GRACE_S,
        poll_interval_s: float = DEFAULT_POLL_INTERVAL_S,
    ) -> None:
        try:
            import ray
        except ImportError as error:
            raise EngineError("the ray engine needs ray: pip install 'dlrover[ray]'") from error
        self._ray = ray
        self._owns_connection = not ray.is_initialized()
        if self._owns_connection:
            ray.init(address=address, namespace=namespace, log_to_driver=False)
        self._runner_class: Any = ray.remote(NodeRunner)
        self._launch_timeout_s = launch_timeout_s
        self._stop_grace_s = stop_grace_s
        self._poll_interval_s = poll_interval_s
        self._nodes: dict[str, _RayNode] = {}
        self._queue = EventQueue()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._monitor = threading.Thread(
            target=self._monitor_loop, name="ray-engine-monitor", daemon=True
        )
        self._monitor.start()

    # --- Engine -----------------------------------------------------------------------------
    def launch(self, spec: NodeSpec) -> Node:
        """Request a placement group and a NodeRunner actor that starts the node's command; returns
        the node PENDING (the monitor reports RUNNING, or LAUNCH_FAILED after ``launch_timeout_s``).
        An existing id returns that node; LaunchError if Ray refuses."""
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        with self._lock:
            existing = self._nodes.get(spec.node_id)
            if existing is not None:
                return dataclasses.replace(existing.node)
        adopted = self._adopt(spec)
        if adopted is not None:
            return adopted
        bundle: dict[str, float] = {"CPU": spec.resources.cpu or 1.0}
        if spec.resources.gpu:
            bundle["GPU"] = float(spec.resources.gpu)
        if spec.resources.memory_mib:
            bundle["memory"] = float(spec.resources.memory_mib * 1024 * 1024)
        try:
            group = placement_group(
                [bundle], strategy="SPREAD", name=spec.node_id, lifetime="detached"
            )
            actor: Any = self._runner_class.options(
                name=spec.node_id,
                lifetime="detached",
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                memory=bundle.get("memory"),
                max_restarts=0,
                max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=group, placement_group_bundle_index=0
                ),
            ).remote()
            start_ref = actor.start.remote(list(spec.command), dict(spec.env), spec.node_id)
        except Exception as error:  # Ray raises ValueError/RayError subclasses here
            raise LaunchError(f"{spec.node_id}: Ray refused the node: {error}") from error
        log.info("node %s: placement group requested %s", spec.node_id, bundle)
        return self._track(spec, group, actor, start_ref, "")

    def _track(self, spec: NodeSpec, group: Any, actor: Any, start_ref: Any, message: str) -> Node:
        """Watch a node's actor from now on (its start or info call answers first); the node
        is PENDING until then."""
        node = Node(spec=spec)
        with self._lock:
            self._nodes[spec.node_id] = _RayNode(
                node=node,
                placement_group=group,
                actor=actor,
                launched_at=time.monotonic(),
                start_ref=start_ref,
            )
        self._queue.put(NodeEvent(spec.node_id, spec, NodeState.PENDING, message=message))
        return dataclasses.replace(node)

    def _adopt(self, spec: NodeSpec) -> Node | None:
        """The node of ``spec`` PENDING if an earlier engine left its actor alive (it reports
        RUNNING, or its end, once the actor answers); else None."""
        from ray.util.placement_group import get_placement_group

        try:
            actor = self._ray.get_actor(spec.node_id)
        except ValueError:
            return None  # no live actor by that name
        try:
            group = get_placement_group(spec.node_id)
        except ValueError:
            group = None  # removed already; killing the actor is all a delete needs
        log.info(
            "node %s: adopting its running actor (launched by an earlier master)", spec.node_id
        )
        return self._track(spec, group, actor, actor.info.remote(), "adopted")

    def delete(self, node_id: str) -> None:
        """Stop the node's command through its actor (SIGTERM, ``stop_grace_s``, SIGKILL), then kill
        the actor and remove its placement group; the monitor reports DELETED. Nothing for a node
        that ended or is being deleted; NodeNotFoundError for an unknown id."""
        with self._lock:
            entry = self._nodes.get(node_id)
            if entry is None:
                raise NodeNotFoundError(node_id)
            if entry.node.state.is_final or entry.deleting:
                return
            entry.deleting = True
        try:
            self._ray.get(
                entry.actor.stop.remote(self._stop_grace_s), timeout=self._stop_grace_s + 5
            )
        except Exception as error:  # the actor may already be gone; killing it below suffices
            log.info("node %s: graceful stop failed (%s); killing the actor", node_id, error)
        self._kill(entry)

    def logs(self) -> RayNodeLogs:
        """The nodes' logs, read by their actors on the machines they run on."""
        return RayNodeLogs(self)

    def _actor_call(self, node_id: str, method: str, *args: object) -> Any:
        """``method`` of node ``node_id``'s actor, or None for an unknown or gone node."""
        with self._lock:
            entry = self._nodes.get(node_id)
        if entry is None or entry.node.state.is_final:
            return None
        try:
            return self._ray.get(getattr(entry.actor, method).remote(*args), timeout=LOG_TIMEOUT_S)
        except Exception as error:  # a node going away as it is asked: no log, not an error
            log.info("node %s: cannot read its logs: %s", node_id, error)
            return None

    def capacity(self) -> Capacity:
        """What the Ray cluster has free now (CPU, memory); unknown if Ray does not say."""
        try:
            free = self._ray.available_resources()
        except Exception as error:  # a GCS hiccup: unknown, not fatal
            log.warning("cannot read Ray's free resources: %s", error)
            return Capacity()
        memory = free.get("memory")
        return Capacity(float(free.get("CPU", 0.0)), None if memory is None else int(memory) >> 20)

    def list_nodes(self) -> list[Node]:
        """Copies of every node launched, with their current states."""
        with self._lock:
            return [dataclasses.replace(entry.node) for entry in self._nodes.values()]

    def events(self, timeout: float) -> list[NodeEvent]:
        """Queued node events, waiting up to ``timeout`` seconds for the first."""
        return self._queue.drain(timeout)

    def close(self, delete_nodes: bool = True) -> None:
        """With ``delete_nodes``, delete every live node and wait (at most ``stop_grace_s`` + 5 s)
        for their final events; then stop the monitor, and disconnect from Ray if this engine
        connected."""
        if delete_nodes:
            with self._lock:
                live = [e.node.node_id for e in self._nodes.values() if not e.node.state.is_final]
            self.delete_many(live)
            # The monitor reports the DELETED events; give it a bounded moment to do so.
            deadline = time.monotonic() + self._stop_grace_s + 5
            while time.monotonic() < deadline and any(
                not e.node.state.is_final for e in self._nodes.values()
            ):
                time.sleep(self._poll_interval_s)
        self._stop.set()
        self._monitor.join(timeout=self._poll_interval_s * 10 + 5)
        if self._owns_connection:
            self._ray.shutdown()

    # --- monitoring -------------------------------------------------------------------------
    def _kill(self, entry: _RayNode) -> None:
        from ray.util.placement_group import remove_placement_group

        try:
            self._ray.kill(entry.actor, no_restart=True)
        except Exception as error:  # already dead is fine
            log.debug("node %s: ray.kill: %s", entry.node.node_id, error)
        if entry.placement_group is None:
            return
        try:
            remove_placement_group(entry.placement_group)
        except Exception as error:  # already removed is fine
            log.debug("node %s: remove placement group: %s", entry.node.node_id, error)

    def _monitor_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                pending = {
                    id(ref): (entry, ref)
                    for entry in self._nodes.values()
                    for ref in (entry.start_ref, entry.wait_ref)
                    if ref is not None
                }
            if not pending:
                self._stop.wait(self._poll_interval_s)
                continue
            refs = [ref for _, ref in pending.values()]
            ready, _ = self._ray.wait(refs, num_returns=1, timeout=self._poll_interval_s)
            if ready:
                ready, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in ready:
                entry, _ = pending[id(ref)]
                if ref is entry.start_ref:
                    self._on_started(entry)
                else:
                    self._on_exited(entry)
            self._expire_launches()

    def _expire_launches(self) -> None:
        now = time.monotonic()
        with self._lock:
            stuck = [
                e
                for e in self._nodes.values()
                if e.start_ref is not None
                and not e.deleting
                and now - e.launched_at > self._launch_timeout_s
            ]
        for entry in stuck:
            self._kill(entry)
            self._finish(
                entry,
                NodeState.FAILED,
                FailureReason.LAUNCH_FAILED,
                message=f"no Ray node offered {entry.node.spec.resources} within "
                f"{self._launch_timeout_s:.0f}s",
            )

    def _on_started(self, entry: _RayNode) -> None:
        try:
            info = self._ray.get(entry.start_ref)
        except Exception as error:
            self._on_actor_error(entry, error)
            return
        entry.start_ref = None
        entry.ray_node_id = str(info["ray_node_id"])
        if entry.deleting:
            entry.wait_ref = entry.actor.wait.remote()
            return
        entry.wait_ref = entry.actor.wait.remote()
        with self._lock:
            entry.node.state = NodeState.RUNNING
            entry.node.host = entry.ray_node_id
        spec = entry.node.spec
        log.info(
            "node %s: pending -> running on Ray node %s (pid %s)",
            spec.node_id,
            entry.ray_node_id,
            info["pid"],
        )
        self._queue.put(
            NodeEvent(
                spec.node_id,
                spec,
                NodeState.RUNNING,
                host=entry.ray_node_id,
                message=f"pid {info['pid']} on {info['hostname']}",
            )
        )

    def _on_exited(self, entry: _RayNode) -> None:
        try:
            returncode = int(self._ray.get(entry.wait_ref))
        except Exception as error:
            self._on_actor_error(entry, error)
            return
        entry.wait_ref = None
        self._kill(entry)
        if returncode == 0:
            self._finish(entry, NodeState.SUCCEEDED, exit_code=0)
        elif returncode < 0:
            name = signal.Signals(-returncode).name
            self._finish(
                entry,
                NodeState.FAILED,
                FailureReason.SIGNAL,
                signal=-returncode,
                message=f"killed by {name}",
            )
        else:
            self._finish(
                entry,
                NodeState.FAILED,
                FailureReason.EXIT_CODE,
                exit_code=returncode,
                message=f"exited with code {returncode}",
            )

    def _on_actor_error(self, entry: _RayNode, error: Exception) -> None:
        entry.start_ref = entry.wait_ref = None
        self._kill(entry)
        text = str(error)
        if "OutOfMemory" in type(error).__name__ or "memory" in text.lower() and "kill" in text:
            reason = FailureReason.OOM_KILLED
        else:
            reason = FailureReason.NODE_LOST
        where = entry.ray_node_id or "an unknown Ray node"
        alive = self._ray_node_alive(entry.ray_node_id)
        detail = "its Ray node died" if alive is False else "its actor died"
        self._finish(
            entry,
            NodeState.FAILED,
            reason,
            message=f"{detail} ({where}): {type(error).__name__}: {text[:300]}",
        )

    def _ray_node_alive(self, ray_node_id: str) -> bool | None:
        if not ray_node_id:
            return None
        try:
            for info in self._ray.nodes():
                if info.get("NodeID") == ray_node_id:
                    return bool(info.get("Alive"))
        except Exception as error:  # a GCS hiccup must not kill the monitor
            log.warning("cannot read Ray node table: %s", error)
        return None

    def _finish(
        self,
        entry: _RayNode,
        state: NodeState,
        reason: FailureReason | None = None,
        exit_code: int | None = None,
        signal: int | None = None,
        message: str = "",
    ) -> None:
        with self._lock:
            if entry.node.state.is_final:
                return
            if entry.deleting:
                state, reason, exit_code, signal, message = (
                    NodeState.DELETED,
                    None,
                    None,
                    None,
                    "deleted on request",
                )
            old = entry.node.state
            entry.node.state = state
            entry.start_ref = entry.wait_ref = None
        spec = entry.node.spec
        event = NodeEvent(
            spec.node_id, spec, state, reason, exit_code, signal, message, host=entry.ray_node_id
        )
        log.info("node %s: %s -> %s", spec.node_id, old.value, event.outcome())
        self._queue.put(event)


LOG_TIMEOUT_S = 10.0
"""How long a node actor may take to read its logs."""


class RayNodeLogs:
    """`NodeLogs` of a Ray engine's nodes: each read runs in the node's actor, where its files
    are."""

    def __init__(self, engine: RayEngine) -> None:
        self._engine = engine

    def tail(self, node_id: str, rank: int | None, lines: int) -> str | None:
        """See `NodeLogs.tail`."""
        text = self._engine._actor_call(node_id, "tail", rank, lines)
        return None if text is None else str(text)

    def ranks(self, node_id: str) -> tuple[int, ...]:
        """See `NodeLogs.ranks`."""
        return tuple(int(r) for r in self._engine._actor_call(node_id, "ranks") or ())

    def node_ids(self) -> tuple[str, ...]:
        """See `NodeLogs.node_ids`: the live node actors."""
        return tuple(sorted(n.node_id for n in self._engine.list_nodes() if not n.state.is_final))

    def read(self, node_id: str, rank: int | None, stream: str, offset: int) -> LogChunk | None:
        """See `NodeLogs.read`."""
        doc = self._engine._actor_call(node_id, "read", rank, stream, offset)
        if doc is None:
            return None
        return LogChunk(str(doc["text"]), int(doc["offset"]), str(doc["source"]))
