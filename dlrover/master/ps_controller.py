"""The master's embedding servers (role ``ps``): launched through the job's engine, installed and
published to the workers, replaced from a replica when one fails, resized on request, and read
for the metrics.

One thread does the work, in order, from a queue: a failover and a resize never overlap, and
neither blocks the node controller's loop (their RPCs take seconds). The servers' placement is
published in the master's key-value store (the `PLACEMENT` channel), where workers find it; every
`dlrover-ps` the engine starts registers its address there first (`PS_ADDRESS`).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

from dlrover.constants import ENV_NODE_NAME
from dlrover.coordination import PS_ADDRESS, PS_SCALE, ScaleReport
from dlrover.embedding.client import EmbeddingClient
from dlrover.embedding.cluster import EmbeddingCluster, ResizeStuckError
from dlrover.embedding.table import EmbeddingError
from dlrover.embedding.wire import PLACEMENT
from dlrover.engines.base import Engine, EngineError, NodeEvent, NodeSpec, NodeState
from dlrover.jobspec import JobSpec
from dlrover.master.job import JobMaster
from dlrover.master.optimizer import ScaleAction, plan_ps
from dlrover.master.relaunch_policy import OomPolicy, RelaunchPolicy
from dlrover.master.roles import RoleNode, ServerStats
from dlrover.master.slot_supervisor import SlotSupervisor
from dlrover.master.state_store import MemoryStateStore, StateStore
from dlrover.proto import embedding_pb2 as pb

logger = logging.getLogger(__name__)

DEFAULT_ADDRESS_TIMEOUT_S = 120.0
"""How long a launched `dlrover-ps` has to register its address before it counts as failed."""
DEFAULT_STATS_INTERVAL_S = 5.0
"""How often the servers' stats are read for the metrics (and the auto-scaler)."""
GROW_COOLDOWN_S = 60.0
"""With ``--auto-scale``: the least time between two servers added because they filled up."""

REPLICA_MODES = {"async": pb.ASYNC, "sync": pb.SYNC, "none": pb.NO_REPLICA}

_NAMESPACE = "ps"


class PsLaunchError(Exception):
    """An embedding server could not be brought up (launch refused, died, never registered)."""


class PsController:
    """Owns the job's embedding servers: server ``i`` of the placement is node slot ``i`` of
    role ``ps``. Thread-safe entry points: `on_event`, `request_scale`, `stats`."""

    def __init__(
        self,
        job: JobMaster,
        engine: Engine,
        spec: JobSpec,
        master_addr: str,
        token: str,
        oom_policy: OomPolicy | None = None,
        store: StateStore | None = None,
        address_timeout_s: float = DEFAULT_ADDRESS_TIMEOUT_S,
        stats_interval_s: float = DEFAULT_STATS_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        supervisor: SlotSupervisor | None = None,
    ) -> None:
        """``supervisor`` relaunches the servers' slots (the job's one, shared with its node
        controller; by default one over ``store`` with ``oom_policy``)."""
        if spec.ps is None:
            raise ValueError(f"job {spec.name} has no ps role")
        self._job = job
        self._engine = engine
        self._spec = spec
        self._ps = spec.ps
        self._master_addr = master_addr
        self._token = token
        self._store = store or MemoryStateStore()
        self._supervisor = supervisor or SlotSupervisor(
            job.diagnostics,
            RelaunchPolicy(spec.max_relaunches, oom_policy or OomPolicy()),
            self._store,
        )
        """Decides, records and saves each server slot's attempts."""
        self._supervisor.role("ps", self._node_spec)
        self._address_timeout_s = address_timeout_s
        self._stats_interval_s = stats_interval_s
        self._clock = clock
        self._requests: queue.Queue[tuple[str, str | int, int]] = queue.Queue()
        """(kind, node id or server count, request id) for the controller's thread."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._nodes: list[NodeSpec] = []
        """The current server of each index (its node's spec)."""
        self._cluster: EmbeddingCluster | None = None
        self._stats: list[ServerStats] = []
        self._last_lookups: dict[str, tuple[float, int]] = {}
        self._failed: dict[str, NodeEvent] = {}
        """Failure events of servers whose replacement is queued (OOM: the next gets more)."""
        self._retired: set[str] = set()
        """Servers this controller deleted (their end is no failure)."""
        self._request_ids = 0
        self._stats_thread: threading.Thread | None = None
        self.failovers = 0
        self._grown_at: float | None = None
        self.ready = threading.Event()
        """Set once the servers are installed and their placement published."""

    # --- entry points (any thread) ------------------------------------------------------------
    def start(self) -> None:
        """Launch the servers and bring them up in the background."""
        self._thread = threading.Thread(target=self._run, name="ps-controller", daemon=True)
        self._thread.start()
        # Stats are read by a thread of their own: a hung server's 30 s deadline must not
        # hold up a failover or a resize.
        self._stats_thread = threading.Thread(target=self._stats_loop, name="ps-stats", daemon=True)
        self._stats_thread.start()

    def close(self) -> None:
        """Stop the background threads (the engine deletes the servers with the job's nodes)."""
        self._stop.set()
        self._requests.put(("stop", 0, 0))
        for thread in (self._thread, self._stats_thread):
            if thread is not None:
                thread.join(35.0)
        if self._cluster is not None:
            self._cluster.client.close()

    def on_event(self, event: NodeEvent) -> None:
        """An engine event of a ``ps`` node: a current server that ended (failed, or exited
        when nobody asked it to: SIGTERM, eviction) is replaced."""
        logger.info("engine: %s", event)
        if not event.state.is_final or self._job.lifecycle.ended.is_set():
            return
        with self._lock:
            if event.node_id in self._retired:
                return
            current = any(n.node_id == event.node_id for n in self._nodes)
            if current:
                self._failed[event.node_id] = event
        if current:
            self._requests.put(("replace", event.node_id, 0))

    def request_scale(self, role: str, count: int) -> tuple[str, int]:
        """Ask for ``count`` servers (``role`` is ``ps``, the registry's key); returns what will
        happen and the request's id (its report on the PS_SCALE channel carries it). Raises ValueError
        when it cannot be done."""
        if count < 1:
            raise ValueError(f"--count {count}: a job with embedding servers keeps at least 1")
        if not self.ready.is_set():
            raise ValueError("the embedding servers are not installed yet; ask again shortly")
        with self._lock:
            self._request_ids += 1
            request = self._request_ids
        self._requests.put(("scale", count, request))
        note = (
            "; with 1 server there is no replica: its failure stops the job"
            if count == 1 and self._ps.replica != "none"
            else ""
        )
        return f"embedding servers: scaling to {count}{note}", request

    def stats(self) -> list[ServerStats]:
        """Each server's last stats (empty before the first read)."""
        with self._lock:
            return list(self._stats)

    def role_nodes(self) -> list[RoleNode]:
        """Each embedding server (role ``ps``) as `dlrover status`, /metrics and the dashboard
        show it: its current attempt, failures relaunched, and its last stats' CPU and memory."""
        with self._lock:
            nodes, failed = list(self._nodes), set(self._failed)
            stats = {s.index: s for s in self._stats}
        limit = self._ps.resources.memory_mib << 20 if self._ps.resources.memory_mib else 0
        rows = []
        for index, spec in enumerate(nodes):
            s = stats.get(index)
            rows.append(
                RoleNode(
                    node_id=spec.node_id,
                    role="ps",
                    index=index,
                    state="failed" if spec.node_id in failed else "running" if s else "pending",
                    relaunches=self._supervisor.used("ps", spec.rank),
                    cpu_percent=s.cpu_percent if s else 0.0,
                    memory_bytes=s.memory_bytes if s else 0,
                    memory_limit_bytes=limit,
                    pid=s.pid if s else 0,
                )
            )
        return rows

    @property
    def addresses(self) -> tuple[str, ...]:
        """The servers' addresses, server 0 first (empty before they are installed)."""
        cluster = self._cluster
        return cluster.client.addresses if cluster is not None else ()

    # --- the worker thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._bring_up()
        except (PsLaunchError, EmbeddingError, EngineError) as e:
            self._job.lifecycle.stop(f"the embedding servers could not start: {e}")
            return
        except Exception as e:  # a bug: said, and the job stops rather than hang
            logger.exception("embedding servers: bring-up failed")
            self._job.lifecycle.stop(f"the embedding servers could not start: {e!r}")
            return
        while not self._stop.is_set() and not self._job.lifecycle.ended.is_set():
            kind, value, request = self._requests.get()
            try:
                if kind == "replace":
                    self._replace(str(value))
                elif kind == "scale":
                    self._scale(int(value), request)
            except (PsLaunchError, EmbeddingError, EngineError) as e:
                what = "failover" if kind == "replace" else f"scaling to {value}"
                logger.error("embedding servers: %s failed: %s", what, e)
                self._report(ScaleReport(kind, 0, request=request, error=str(e)))
                if kind == "replace" or isinstance(e, ResizeStuckError):
                    # The workers cannot go on without the server's rows, or on a half-moved
                    # map.
                    self._job.lifecycle.stop(f"embedding servers: {what} failed: {e}")
            except Exception as e:
                logger.exception("embedding servers: %s failed", kind)
                self._report(ScaleReport(kind, 0, request=request, error=repr(e)))
                self._job.lifecycle.stop(f"embedding servers: {kind} failed: {e!r}")

    def _stats_loop(self) -> None:
        while (
            not self._stop.wait(self._stats_interval_s) and not self._job.lifecycle.ended.is_set()
        ):
            if not self.ready.is_set():
                continue
            try:
                self._read_stats()
                self._grow_if_full()
            except Exception:  # metrics must never take the controller down
                logger.exception("embedding servers: reading their stats failed")

    def _bring_up(self) -> None:
        if self._resume():
            return
        count = self._ps.count
        logger.info("launching %d embedding servers (replica %s)", count, self._ps.replica)
        specs = [self._supervisor.current("ps", r) for r in range(count)]
        self._engine.launch_many(specs)
        addresses = [self._await_address(s) for s in specs]
        self._set_nodes(specs)
        client = EmbeddingClient(addresses, self._token)
        self._cluster = EmbeddingCluster(client, REPLICA_MODES[self._ps.replica])
        self._cluster.install()
        self._publish()
        self._report(ScaleReport("install", count))
        self.ready.set()
        logger.info("embedding servers ready: %s", ", ".join(addresses))
        self._job.diagnostics.event("ps", f"{count} embedding servers ready")

    def _resume(self) -> bool:
        """A master restarted on its state takes over the servers its predecessor installed:
        the engine adopts the ones still running, a dead one is replaced from its replica.
        False when there is nothing to resume."""
        saved = self._store.get_json(_NAMESPACE, "nodes")
        placement = PLACEMENT.get(self._job.kv)
        if not saved or placement is None:
            return False
        specs = [self._resumed(rank, attempt) for rank, attempt in saved["nodes"]]
        if saved.get("resizing"):
            raise PsLaunchError(
                "the master stopped while it was resizing the embedding servers; the servers "
                "may hold a half-moved map, so the job stops rather than train on it (restart "
                "it from its checkpoint)"
            )
        self._engine.launch_many(specs)  # adopted where they still run
        with self._lock:
            self._nodes = specs
        client = EmbeddingClient(placement.addresses, self._token, placement.map)
        self._cluster = EmbeddingCluster(client, REPLICA_MODES[self._ps.replica])
        alive = self._each_answers(client, placement.addresses)
        for index, (address, ok) in enumerate(zip(placement.addresses, alive, strict=True)):
            if not ok:
                logger.warning(
                    "embedding server %d at %s did not survive: replacing it", index, address
                )
                self._retire(specs[index])  # the engine may have started its slot again
                with self._lock:
                    self._failed.pop(specs[index].node_id, None)
                self._requests.put(("replace", specs[index].node_id, 0))
        self.ready.set()
        logger.info("embedding servers resumed: %s", ", ".join(placement.addresses))
        return True

    def _each_answers(self, client: EmbeddingClient, addresses: tuple[str, ...]) -> list[bool]:
        def answers(address: str) -> bool:
            try:
                client.server(address).stats()
                return True
            except EmbeddingError:
                return False

        return [answers(a) for a in addresses]

    def _set_nodes(self, nodes: list[NodeSpec], resizing: bool = False) -> None:
        """The current server of each index, saved so that a restarted master resumes them
        (with ``resizing``: a resize is under way, which a restarted master cannot resume)."""
        with self._lock:
            self._nodes = nodes
            state = {"nodes": [[n.rank, n.relaunch_count] for n in nodes], "resizing": resizing}
        self._store.put_json(_NAMESPACE, "nodes", state)

    def _resumed(self, rank: int, attempt: int) -> NodeSpec:
        """Attempt ``attempt`` of server slot ``rank`` as it was launched: with the memory it
        grew to after OOM kills, when the supervisor's record is of that attempt."""
        spec = self._node_spec(rank, attempt)
        record = self._supervisor.record("ps", rank)
        if record is not None and record.attempt == attempt and record.resources is not None:
            spec = dataclasses.replace(spec, resources=record.resources)
        return spec

    def _node_spec(self, rank: int, attempt: int) -> NodeSpec:
        """Attempt ``attempt`` of server slot ``rank`` (the supervisor's builder for ``ps``)."""
        return self._named(self._spec.ps_node_spec(rank, self._master_addr, self._token, attempt))

    def _retire(self, spec: NodeSpec) -> None:
        """Delete a server this controller no longer wants (its end is not a failure)."""
        with self._lock:
            self._retired.add(spec.node_id)
        try:
            self._engine.delete(spec.node_id)
        except EngineError as e:
            logger.warning("embedding server %s: cannot delete it: %s", spec.node_id, e)

    def _named(self, spec: NodeSpec) -> NodeSpec:
        return dataclasses.replace(spec, env={**spec.env, ENV_NODE_NAME: spec.node_id})

    def _await_address(self, spec: NodeSpec) -> str:
        """The address the launched server registers, or PsLaunchError if it dies or stays
        silent for the address timeout."""
        deadline = self._clock() + self._address_timeout_s
        while self._clock() < deadline:
            if self._stop.is_set() or self._job.lifecycle.ended.is_set():
                raise PsLaunchError("the job ended")
            address = PS_ADDRESS.get(self._job.kv, spec.node_id, wait_s=0.5)
            if address:
                return address
            node = next((n for n in self._engine.list_nodes() if n.node_id == spec.node_id), None)
            if node is not None and node.state.is_final:
                raise PsLaunchError(
                    f"embedding server {spec.node_id} ended ({node.state.value}) before it "
                    "registered its address; see its log"
                )
        raise PsLaunchError(
            f"embedding server {spec.node_id} did not register its address within "
            f"{self._address_timeout_s:.0f}s (is dlrover-ps installed where it runs?)"
        )

    def _publish(self) -> None:
        assert self._cluster is not None
        PLACEMENT.put(self._job.kv, self._cluster.client.placement)

    def _report(self, report: ScaleReport) -> None:
        """Store ``report`` with the servers the job has now and the wall time."""
        now = dataclasses.replace(report, servers=len(self._nodes), time=time.time())
        PS_SCALE.put(self._job.kv, now)

    def _replace(self, node_id: str) -> None:
        assert self._cluster is not None
        with self._lock:
            index = next((i for i, n in enumerate(self._nodes) if n.node_id == node_id), None)
            event = self._failed.pop(node_id, None)
            failed = self._nodes[index] if index is not None else None
            servers = len(self._nodes)
        if index is None or failed is None:
            logger.info("embedding server %s is not current any more: not replaced", node_id)
            return
        if self._ps.replica == "none" or servers < 2:
            raise PsLaunchError(
                f"embedding server {index} ({node_id}) ended and there is no replica to restore "
                f"it from ({'roles.ps.replica: none' if servers >= 2 else 'a single server'}); "
                "its rows are lost"
            )
        # A server that did not survive the master's restart has no event: it is replaced as
        # an exited one, and not recorded (its failure, if any, was).
        recorded = event is not None
        if event is None:
            event = NodeEvent(failed.node_id, failed, NodeState.FAILED)
        verdict = self._supervisor.judge(event, label=f"embedding server {index}", record=recorded)
        started = self._clock()
        while True:
            spec = verdict.replacement
            if verdict.cannot_grow:
                raise PsLaunchError(f"embedding server {node_id} was OOM-killed and cannot grow")
            if spec is None:
                raise PsLaunchError(
                    f"embedding server {index} ended and its slot used its "
                    f"{self._spec.max_relaunches} relaunches (max_relaunches)"
                )
            logger.info(
                "embedding server %d (%s) ended: launching %s", index, node_id, spec.node_id
            )
            self._engine.launch(spec)
            try:
                address = self._await_address(spec)
                break
            except PsLaunchError as e:  # the replacement died before it registered
                logger.warning("embedding server %d: its replacement failed: %s", index, e)
                self._retire(spec)
                stillborn = NodeEvent(spec.node_id, spec, NodeState.FAILED, message=str(e))
                verdict = self._supervisor.judge(stillborn, record=False)
        report = self._cluster.replace(index, address)
        with self._lock:
            nodes = list(self._nodes)
        nodes[index] = spec
        self._set_nodes(nodes)
        self._publish()
        self.failovers += 1
        seconds = self._clock() - started
        self._report(
            ScaleReport(
                "replace",
                0,
                index=index,
                node=spec.node_id,
                restored_rows=report.restored_rows,
                replica_last_heard_s=report.last_heard_s,
                seconds=seconds,
            )
        )
        self._job.diagnostics.event(
            "ps",
            f"embedding server {index} replaced by {spec.node_id} in {seconds:.1f}s: "
            f"{report.restored_rows} rows from its replica",
        )

    def _scale(self, count: int, request: int = 0) -> None:
        assert self._cluster is not None
        with self._lock:
            nodes = list(self._nodes)
        before = len(nodes)
        if count == before:
            self._report(ScaleReport("scale", 0, request=request, count=count, moved_buckets=0))
            return
        started = self._clock()
        added: list[NodeSpec] = []
        addresses = list(self._cluster.client.addresses)
        try:
            if count > before:
                added = [self._supervisor.open("ps", r) for r in range(before, count)]
                self._engine.launch_many(added)
                addresses += [self._await_address(s) for s in added]
            else:
                addresses = addresses[:count]
            self._set_nodes(nodes, resizing=True)
            report = self._cluster.resize(addresses)
        except (PsLaunchError, EngineError, EmbeddingError) as e:
            if not isinstance(e, ResizeStuckError):
                self._set_nodes(nodes)  # rolled back (or never started): the old servers stand
                self._publish()
                for spec in added:
                    self._retire(spec)
            raise
        self._set_nodes(nodes[:count] + added)
        self._publish()
        for node in nodes[count:]:
            self._retire(node)
        seconds = self._clock() - started
        logger.info(
            "embedding servers %d -> %d in %.1fs: %d buckets, %d rows moved, moving buckets "
            "paused %.3fs",
            before, count, seconds, report.moved_buckets, report.moved_rows, report.pause_s,
        )  # fmt: skip
        self._report(
            ScaleReport(
                "scale",
                0,
                request=request,
                count=count,
                moved_buckets=report.moved_buckets,
                moved_rows=report.moved_rows,
                pause_s=report.pause_s,
                seconds=seconds,
            )
        )
        self._job.diagnostics.event(
            "ps",
            f"embedding servers {before} -> {count}: {report.moved_rows} rows moved, "
            f"{report.pause_s:.2f}s pause",
        )

    def _grow_if_full(self) -> None:
        """``--auto-scale``: one more server while the fullest passes its fill (optimizer.py)."""
        if not self._spec.auto_scale or self._ps.max_count <= self._ps.count:
            return
        now = self._clock()
        if self._grown_at is not None and now - self._grown_at < GROW_COOLDOWN_S:
            return
        stats = self.stats()
        with self._lock:
            servers = len(self._nodes)
        if len(stats) != servers:
            return  # a server did not answer: its failover comes first
        plan = plan_ps(
            servers,
            [s.bytes for s in stats],
            self._ps.resources.memory_mib,
            self._ps.max_count,
            replicated=self._ps.replica != "none",
        )
        if plan.action is ScaleAction.SCALE_OUT:
            self._grown_at = now
            logger.info(
                "auto-scale: embedding servers: %d -> %d: %s", servers, plan.nodes, plan.reason
            )
            self._job.diagnostics.event(
                "scale", f"embedding servers -> {plan.nodes}: {plan.reason}"
            )
            self._requests.put(("scale", plan.nodes, 0))

    def _read_stats(self) -> None:
        cluster = self._cluster
        if cluster is None:
            return
        now = self._clock()
        seen: list[ServerStats] = []
        for index, address in enumerate(cluster.client.addresses):
            try:
                s = cluster.client.server(address).stats()
            except EmbeddingError:
                continue  # a failed server: its event brings the failover
            lookups = sum(t.lookups for t in s.tables)
            then = self._last_lookups.get(address)
            rate = (lookups - then[1]) / (now - then[0]) if then and now > then[0] else 0.0
            self._last_lookups[address] = (now, lookups)
            seen.append(
                ServerStats(
                    index=index,
                    address=address,
                    rows=sum(t.rows for t in s.tables),
                    bytes=sum(t.bytes for t in s.tables),
                    lookups=lookups,
                    pushes=sum(t.pushes for t in s.tables),
                    lookups_per_s=max(0.0, rate),
                    rows_moved_in=s.rows_moved_in,
                    rows_moved_out=s.rows_moved_out,
                    cpu_percent=s.cpu_percent,
                    memory_bytes=s.memory_bytes,
                    pid=s.pid,
                )
            )
        with self._lock:
            self._stats = seen
