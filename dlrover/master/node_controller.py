"""The master's node controller: launches the job's nodes through an engine, replaces lost ones."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Protocol

from dlrover.api.master import FailureClass
from dlrover.constants import (
    CANNOT_START_EXIT_CODE,
    DEFAULT_SILENT_REPLACE_S,
    ENV_NODE_NAME,
    ENV_SILENT_REPLACE_S,
    EXIT_NODE_EXCLUDED,
)
from dlrover.decisions import FailureAction
from dlrover.engines.base import (
    Engine,
    EngineError,
    FailureReason,
    LaunchManyError,
    Node,
    NodeEvent,
    NodeSpec,
    NodeState,
    Resources,
)
from dlrover.envvars import number_from_env
from dlrover.jobspec import JobSpec, JobSpecError
from dlrover.master.job import JobMaster
from dlrover.master.launch_queue import LaunchQueue
from dlrover.master.node_policy import NodeLossReason
from dlrover.master.nodes import ALIVE_STATES, NodeError
from dlrover.master.relaunch_policy import OomPolicy, RelaunchPolicy, failure_class_of
from dlrover.master.slot_supervisor import SlotSupervisor
from dlrover.master.state_store import MemoryStateStore, StateStore

if TYPE_CHECKING:  # an arrow down only: ps_controller imports no controller
    from dlrover.master.ps_controller import PsController

__all__ = ["NodeController", "Scaler", "failure_class_of"]

logger = logging.getLogger(__name__)

_NAMESPACE = "controller"


class Scaler(Protocol):
    """What the node controller asks of its auto-scaler (dlrover/master/autoscaler.py)."""

    @property
    def horizontal(self) -> bool:
        """Whether the job may scale out and in (it then starts at min nodes)."""
        ...

    def tick(self) -> None:
        """Plan (and act through the controller) if a period passed."""


class NodeController:
    """Applies the node-loss policy to engine events; the policy never knows the engine.

    Invariant: every slot (rank) of the job has at most one live node; a replacement gets the
    same rank and the next relaunch count, and all replacements of one batch of events are
    launched in parallel. The job's slot supervisor decides, records and saves each slot's
    attempts, so a master restarted on its state launches the same attempts again, which an
    engine that knows them (Kubernetes: the pod exists, 409) adopts instead of duplicating.
    """

    def __init__(
        self,
        job: JobMaster,
        engine: Engine,
        spec: JobSpec,
        master_addr: str,
        token: str,
        oom_policy: OomPolicy | None = None,
        relaunch_delay_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        store: StateStore | None = None,
        scaler: Callable[[NodeController], Scaler] | None = None,
        ps: PsController | None = None,
        supervisor: SlotSupervisor | None = None,
        silent_replace_s: float | None = None,
    ) -> None:
        """``scaler`` builds the auto-scaler that reads this controller (`--auto-scale`); ``ps``
        drives the job's embedding servers; ``supervisor`` relaunches the job's slots (the one
        ``ps`` shares; by default one over ``store`` with ``oom_policy``); ``silent_replace_s``:
        how long a node lost to silence may come back before it is replaced (default
        DLROVER_SILENT_REPLACE_S, else 10 s). The controller
        registers itself (and ``ps``) in the job's role registry."""
        self.job = job
        self._store = store or MemoryStateStore()
        self.engine = engine
        self.spec = spec
        self._master_addr = master_addr
        self._token = token
        self.supervisor = supervisor or SlotSupervisor(
            job.diagnostics,
            RelaunchPolicy(spec.max_relaunches, oom_policy or OomPolicy()),
            self._store,
        )
        """Decides, records and saves every slot's attempts (the one every role shares)."""
        self.supervisor.role("worker", self.node_spec)
        self._relaunch_delay_s = relaunch_delay_s
        """Wait this long before replacing a node (back-off against crash loops)."""
        self._clock = clock
        self._due: list[tuple[float, NodeSpec]] = []
        self.relaunches: dict[str, int] = {}
        """Replacements launched, per reason (for metrics and status)."""
        self.scaler: Scaler | None = None
        """Set for `--auto-scale`: plans (and resizes, scales out and in) on every `step`."""
        self.slots = spec.max_nodes
        """Node slots in use: ranks ``0 .. slots-1`` (`start` may begin below max nodes,
        `scale_to` moves it within ``--nnodes MIN:MAX``)."""
        self._ps: PsController | None = None
        self.launches = LaunchQueue(
            engine, capacity=2 * (spec.max_nodes + spec.spares), clock=clock
        )
        """The job's first nodes and every replacement, handed to the engine at its rate."""
        self._silent: list[tuple[float, str, str]] = []
        """(when, node, cause): nodes the job lost to silence (no heartbeat), replaced from
        ``when`` on unless heard again by then."""
        if silent_replace_s is None and os.environ.get(ENV_SILENT_REPLACE_S, "").strip():
            try:
                silent_replace_s = number_from_env(
                    ENV_SILENT_REPLACE_S, DEFAULT_SILENT_REPLACE_S, "a number of seconds"
                )
            except ValueError as e:
                raise JobSpecError(str(e)) from None
        self._silent_grace_s = silent_replace_s
        """Seconds a silent node may come back; None: DEFAULT_SILENT_REPLACE_S, or the job's
        heartbeat timeout where that is longer (a big job's nodes beat every 20 s: one that
        the master lost while it was too busy to hear it gets as long again to be heard)."""
        self._silent_lock = threading.Lock()
        self._deletes = ThreadPoolExecutor(4, thread_name_prefix="engine-delete-silent")
        """Deletes of silent nodes (each may wait out its grace) off the controller's loop."""
        job.members.on_lost.append(self._heard_silent)
        job.roles.register("worker", self)
        if ps is not None:
            self.ps = ps
        if scaler is not None:
            self.scaler = scaler(self)  # last: it reads this controller as it is built

    @property
    def ps(self) -> PsController | None:
        """Set for a job with embedding servers: registered in the job's role registry for
        role ``ps``, so it gets the events of ``ps`` nodes."""
        return self._ps

    @ps.setter
    def ps(self, controller: PsController | None) -> None:
        self._ps = controller
        self.job.roles.register("ps", controller)

    def request_scale(self, role: str, count: int) -> tuple[str, int]:
        """Workers are not scaled on request: ValueError saying how they scale."""
        raise ValueError(
            f"role {role!r}: only ps (embedding servers) is scaled on request; workers scale "
            "within --nnodes MIN:MAX (dlrover submit --auto-scale)"
        )

    def node_spec(self, rank: int, relaunch_count: int = 0) -> NodeSpec:
        """The blueprint of node slot ``rank``, named so that its agent registers under the engine's
        node id."""
        spec = self.spec.node_spec(rank, self._master_addr, self._token, relaunch_count)
        return self._named(spec)

    @staticmethod
    def _named(spec: NodeSpec) -> NodeSpec:
        # The agent registers under the engine's node id, so engine events map to the node table.
        return dataclasses.replace(spec, env={**spec.env, ENV_NODE_NAME: spec.node_id})

    def start(self) -> None:
        """Launch the job's nodes at once: max nodes, or min nodes when the auto-scaler scales
        horizontally (it adds the others as they pay off), or as many as a master before this
        one had; each slot's saved attempt if such a master launched it, else its first."""
        saved = self._store.get_json(_NAMESPACE, "slots")
        if saved is not None:
            self.slots = int(saved["slots"])
        elif self.scaler is not None and self.scaler.horizontal:
            self.slots = self.spec.min_nodes
        # Hot spares take the slots above max nodes: the rendezvous leaves them waiting while
        # the job runs at max nodes, and takes one in when a node is lost.
        slots = self.slots + self.spec.spares
        specs = [self.supervisor.current("worker", rank) for rank in range(slots)]
        resumed = [s.node_id for s in specs if s.relaunch_count > 0]
        logger.info(
            "launching %d nodes of job %s%s%s",
            len(specs),
            self.spec.name,
            f" ({self.spec.spares} of them hot spares)" if self.spec.spares else "",
            f" (resumed attempts: {', '.join(resumed)})" if resumed else "",
        )
        self.launches.put(specs)
        self.launches.pump()  # all of them, unless the engine takes only so many a second

    def scale_to(self, nodes: int, why: str) -> None:
        """Use ``nodes`` slots: launch the missing ones, or delete the highest-ranked live nodes
        (the job re-forms without them and resumes from its last checkpoint)."""
        nodes = max(self.spec.min_nodes, min(self.spec.max_nodes, nodes))
        if nodes == self.slots:
            return
        before, self.slots = self.slots, nodes
        self._store.put_json(_NAMESPACE, "slots", {"slots": nodes})
        logger.info("scaling from %d to %d nodes: %s", before, nodes, why)
        if nodes > before:
            specs = []
            for rank in range(before, nodes):
                # A slot used before (scaled in since) gets its next attempt: a new node name.
                spec = self.supervisor.open("worker", rank)
                self.job.members.expect(spec.node_id)
                specs.append(spec)
            launched = self._launch_scale_out(specs, before)
            self.relaunches["scale_out"] = self.relaunches.get("scale_out", 0) + launched
            return
        kept: list[tuple[float, NodeSpec]] = []
        for due, spec in self._due:
            if spec.rank < nodes:
                kept.append((due, spec))
            else:  # its slot is retired: the job must not wait for it any more
                logger.info("node %s: not relaunched, its slot was scaled in", spec.node_id)
                self.job.members.unexpect(spec.node_id)
        self._due = kept
        for node in self._workers():
            if node.state.is_final or node.spec.rank < nodes:
                continue
            self.job.members.lose(node.node_id, f"removed by the auto-scaler: {why}")
            try:
                self.engine.delete(node.node_id)
            except EngineError as e:
                logger.warning("node %s: cannot delete it for the scale-in: %s", node.node_id, e)
            self.relaunches["scale_in"] = self.relaunches.get("scale_in", 0) + 1

    def _launch_scale_out(self, specs: list[NodeSpec], before: int) -> int:
        """Launch a scale-out's nodes; returns how many were launched. A failed launch is
        logged, not raised (the job goes on with the nodes it has): the job stops expecting the
        nodes that were not launched, and the slots shrink back to the highest launched one."""
        try:
            self.engine.launch_many(specs)
        except EngineError as e:
            launched = {n.node_id for n in e.launched} if isinstance(e, LaunchManyError) else set()
            logger.error("scale-out to %d nodes failed: %s", self.slots, e)
            for spec in specs:
                if spec.node_id not in launched:
                    self.job.members.unexpect(spec.node_id)
            ranks = [spec.rank for spec in specs if spec.node_id in launched]
            self.slots = max(ranks) + 1 if ranks else before
            self._store.put_json(_NAMESPACE, "slots", {"slots": self.slots})
            self.job.diagnostics.event(
                "scale", f"scale-out: {len(launched)} of {len(specs)} launched: {e}"
            )
            return len(launched)
        return len(specs)

    def step(self, timeout_s: float) -> None:
        """Handle the engine events that arrive within `timeout_s`, and replace the nodes the
        job asks to (runtime stragglers)."""
        if self.scaler is not None:
            self.scaler.tick()
        for node_id, cause in self.job.diagnostics.take_replacements():
            spec = self._replace_straggler(node_id, cause)
            if spec is not None:
                self._schedule(spec, self._clock())
        waiting = self.launches.next_due_s()  # launches held back by the engine's rate
        for event in self.engine.events(timeout_s if waiting is None else min(timeout_s, waiting)):
            self.on_event(event)
        now = self._clock()
        with self._silent_lock:
            silent = [(node_id, cause) for due, node_id, cause in self._silent if due <= now]
            self._silent = [entry for entry in self._silent if entry[0] > now]
        if silent:  # after the events: an end the engine saw is that event
            # One look at the engine's nodes and the job's for the whole batch (a rack's worth).
            running = {n.node_id: n for n in self._workers() if not n.state.is_final}
            alive = self.job.members.alive()
        for node_id, cause in silent:
            spec = self._replace_silent(running.get(node_id), cause, alive)
            if spec is not None:
                self._schedule(spec, now + self._relaunch_delay_s)
        replacements = [spec for due, spec in self._due if due <= now]
        self._due = [(due, spec) for due, spec in self._due if due > now]
        if self.job.lifecycle.ended.is_set():
            return
        try:
            self.launches.put(replacements)
            self.launches.pump()
        except EngineError as e:
            logger.error("relaunch failed: %s", e)
            self.job.lifecycle.stop(f"could not relaunch nodes: {e}")

    def _schedule(self, spec: NodeSpec, due: float) -> None:
        """Launch ``spec`` at ``due``; the job expects it from now on."""
        self.job.members.expect(spec.node_id)
        self._due.append((due, self._named(spec)))

    def resize(self, resources: Resources, why: str) -> None:
        """Relaunch every live node with ``resources`` (and launch later nodes so): the job
        re-forms on the new nodes and resumes from its last checkpoint."""
        self.spec = dataclasses.replace(self.spec, resources=resources)
        live = [n for n in self._workers() if not n.state.is_final]
        logger.info(
            "resizing %d node(s) to %d MiB, %g CPU: %s",
            len(live),
            resources.memory_mib,
            resources.cpu,
            why,
        )
        for node in live:
            # Expected before the loss: the job is not "every node lost" meanwhile.
            self.job.members.expect(node.spec.replacement().node_id)
            self.job.members.lose(node.node_id, "relaunched at a new size by the auto-scaler")
            try:
                self.engine.delete(node.node_id)
            except EngineError as e:  # it may still run: a second node in its slot would not do
                logger.warning("node %s: cannot delete it for the resize: %s", node.node_id, e)
                continue
            spec = self.supervisor.replace(node.spec, resources)
            assert spec is not None  # a planned replacement always has one
            self._schedule(spec, self._clock())
            self.relaunches["resize"] = self.relaunches.get("resize", 0) + 1

    def _replace_straggler(self, node_id: str, cause: str) -> NodeSpec | None:
        """Delete a straggler node and return its slot's next attempt (None when the slot used
        up its relaunches, or the node is gone already)."""
        node = next(
            (n for n in self._workers() if n.node_id == node_id and not n.state.is_final),
            None,
        )
        if node is None:
            return None
        spec = self.supervisor.replace(node.spec, failure=(FailureClass.STRAGGLER, cause))
        if spec is None:
            # A slow node is better than none: it is not deleted when it cannot be replaced.
            logger.warning(
                "node %s: a straggler, but its slot used its %d relaunches; keeping it",
                node_id,
                self.spec.max_relaunches,
            )
            self.job.keep_straggler(node_id, cause)
            return None
        # Expected before the loss: the job is never "every node lost" meanwhile.
        self.job.members.expect(spec.node_id)
        self.job.members.lose(node_id, "replaced as a runtime straggler")
        try:
            self.engine.delete(node_id)
        except EngineError as e:
            logger.warning("node %s: cannot delete the straggler: %s", node_id, e)
        self.relaunches["straggler"] = self.relaunches.get("straggler", 0) + 1
        logger.info("node %s: replacing the straggler", node_id)
        return spec

    def _heard_silent(self, node_id: str, cause: str, alive: bool, silent: bool) -> None:
        """`Membership.on_lost`: a live node gone silent is replaced on the next `step` (called
        under the job's lock, from whichever thread lost it)."""
        if silent and alive:
            grace = self._silent_grace_s
            if grace is None:
                grace = max(DEFAULT_SILENT_REPLACE_S, self.job.members.heartbeat_timeout_s())
            with self._silent_lock:
                self._silent.append((self._clock() + grace, node_id, cause))

    def _replace_silent(self, node: Node | None, cause: str, alive: int) -> NodeSpec | None:
        """A node whose heartbeats stopped while the engine still runs it (a machine cut off or
        frozen): the job lost it already and recorded that once. Its slot is relaunched as for
        a lost node, and the silent node is deleted (its pod or process may still run: it must
        not come back beside its replacement). None when the engine saw its end meanwhile
        (``node`` is None: that event relaunched it), the node was heard again, or the slot is
        not relaunched. ``alive``: the job's live nodes."""
        if node is None or self.job.lifecycle.ended.is_set():
            return None
        node_id = node.node_id
        try:
            back = self.job.members.nodes.get(node_id).state in ALIVE_STATES
        except NodeError:
            back = False
        if back:
            logger.info("node %s: heard again before it was replaced; kept", node_id)
            return None
        event = NodeEvent(
            node_id, node.spec, NodeState.FAILED, FailureReason.NODE_LOST, message=cause
        )
        verdict = self.supervisor.judge(
            event, alive_nodes=alive, min_nodes=self.spec.min_nodes, record=False
        )
        logger.info("node %s (silent): %s (%s)", node_id, verdict.action.value, verdict.reason)
        self._deletes.submit(self._delete_quietly, node_id)
        spec = verdict.replacement
        if spec is None:
            if verdict.action is FailureAction.FAIL:
                self.job.lifecycle.stop(verdict.reason)
            return None
        self.job.members.expect(spec.node_id)
        reason = NodeLossReason.HEARTBEAT_TIMEOUT.value
        self.relaunches[reason] = self.relaunches.get(reason, 0) + 1
        return spec

    def _delete_quietly(self, node_id: str) -> None:
        try:
            self.engine.delete(node_id)
        except EngineError as e:
            logger.warning("node %s: cannot delete the silent node: %s", node_id, e)

    def _workers(self) -> list[Node]:
        """The engine's nodes of role ``worker`` (embedding servers are the ps controller's)."""
        return [n for n in self.engine.list_nodes() if n.spec.role == "worker"]

    def on_event(self, event: NodeEvent) -> None:
        """An engine event: a node of another registered role goes to that role's controller; a
        failed worker is replaced (saved, then launched after the relaunch delay) or not, as
        the relaunch policy decides."""
        owner = self.job.roles.owner(event.spec.role)
        if owner is not None and owner is not self:
            owner.on_event(event)
            return
        spec = self._on_event(event)  # saved: a restarted master launches it too
        if spec is not None:
            self._schedule(spec, self._clock() + self._relaunch_delay_s)
            logger.info("node %s: saved, launching in %.1fs", spec.node_id, self._relaunch_delay_s)

    def _on_event(self, event: NodeEvent) -> NodeSpec | None:
        logger.info("engine: %s", event)
        if event.state != NodeState.FAILED or self.job.lifecycle.ended.is_set():
            return None
        slot = self.supervisor.record(event.spec.role, event.spec.rank)
        if slot is not None and slot.attempt > event.spec.relaunch_count:
            # An attempt the slot has moved on from (replaced when it went silent, as a
            # straggler, by a resize): its end changes nothing.
            logger.info(
                "node %s: slot %d is on attempt %d already",
                event.node_id,
                event.spec.rank,
                slot.attempt,
            )
            return None
        if event.spec.rank >= self.slots + self.spec.spares:  # scaled in meanwhile: not in use
            self.job.members.lose(event.node_id, f"{event.message or event.reason} (slot retired)")
            return None
        reason = self.supervisor.policy.loss_reason(event)
        # Expected before the loss is recorded: between the two, the job must not look like
        # it lost every node (withdrawn below if the node is not relaunched).
        successor = event.spec.replacement().node_id
        self.job.members.expect(successor)
        self.job.members.lose(event.node_id, f"{reason.value}: {event.message or event.reason}")
        alive = self.job.members.alive()  # O(1); the node is lost already
        verdict = self.supervisor.judge(
            event,
            alive_nodes=alive,
            min_nodes=self.spec.min_nodes,
            # The node check recorded its exclusion.
            record=event.exit_code != EXIT_NODE_EXCLUDED,
            cause=(
                self.job.diagnostics.last_cause(event.node_id)
                if event.exit_code == CANNOT_START_EXIT_CODE
                else ""
            ),
        )
        logger.info("node %s: %s (%s)", event.node_id, verdict.action.value, verdict.reason)
        spec = verdict.replacement
        if spec is None:
            self.job.members.unexpect(successor)
            if verdict.action is FailureAction.FAIL:
                history = _oom_history(event.spec.rank, verdict.oom_kills)
                self.job.lifecycle.stop(verdict.reason + history)
            return None
        if event.reason is FailureReason.OOM_KILLED:
            logger.info(
                "node %s: OOM-killed with %d MiB; its replacement gets %d MiB",
                event.node_id,
                event.spec.resources.memory_mib,
                spec.resources.memory_mib,
            )
        self.relaunches[reason.value] = self.relaunches.get(reason.value, 0) + 1
        return spec

    def run(
        self,
        stop: threading.Event,
        poll_s: float = 0.5,
        delete_nodes: Callable[[], bool] = lambda: True,
    ) -> None:
        """Drive the controller until the job ends or `stop` is set; then remove every node,
        unless ``delete_nodes()`` says no (another master took the job over: they are its)."""
        try:
            while not self.job.lifecycle.ended.is_set() and not stop.is_set():
                self.step(poll_s)
        finally:
            self._deletes.shutdown(wait=True)
            self.engine.close(delete_nodes=delete_nodes())


def _oom_history(rank: int, oom_kills: tuple[int, ...]) -> str:
    tried = [m for m in oom_kills if m]
    if not tried:
        return ""
    return (
        f"; node slot {rank} was OOM-killed with {', '.join(f'{m} MiB' for m in tried)}: "
        "give each node more memory (resources.memory)"
    )
