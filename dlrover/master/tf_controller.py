"""The master's controller of a TensorFlow parameter-server job: launches every role's nodes,
publishes the cluster spec each node's TF_CONFIG is made of, replaces failed nodes."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from dlrover.constants import CANNOT_START_EXIT_CODE, ENV_NODE_NAME
from dlrover.coordination import (
    PS_SCALE,
    TF_ADDRESS,
    TF_CLUSTER,
    TF_PROGRESS,
    TF_PS_GENERATION,
    TF_READY,
    TF_START_ERROR,
    TF_USAGE,
    KvChannel,
    PsGeneration,
    ScaleReport,
    TfCluster,
)
from dlrover.engines.base import (
    Engine,
    EngineError,
    NodeEvent,
    NodeSpec,
    NodeState,
    Resources,
)
from dlrover.jobspec import TF_ROLES, JobSpec
from dlrover.json_messages import MessageError
from dlrover.master.job import JobMaster
from dlrover.master.ps_load import Rates, Throughput
from dlrover.master.relaunch_policy import OomPolicy, RelaunchPolicy
from dlrover.master.resize import resize_in_place
from dlrover.master.roles import RoleNode
from dlrover.master.slot_supervisor import SlotSupervisor
from dlrover.master.state_store import MemoryStateStore, StateStore
from dlrover.master.tf_scaling import TfPsScaler, TfWorkerScaler
from dlrover.master.tf_sizing import TfSizer
from dlrover.master.tf_slot import Slot, attempt_of, attempt_record

logger = logging.getLogger(__name__)
R = TypeVar("R")

DEFAULT_ADDRESS_TIMEOUT_S = 300.0
"""How long a launched node has to register its address (it imports nothing heavy before)."""
_NAMESPACE = "tf-controller"
CLUSTER_ROLES = ("chief", "ps", "worker")
"""The roles in the cluster spec; the evaluator is not part of it (TensorFlow's convention)."""


class TfController:
    """Drives the nodes of a TensorFlow job through an engine; `step` is one iteration.

    Invariants: each slot has at most one live attempt; the cluster spec is published (a new
    version) only when every slot of the cluster registered, and only when an address changed,
    so a node relaunched on its slot's address changes nothing for the others; the ps
    generation is bumped when every ps of the cluster serves after one of them was relaunched
    (the chief waits for it before it rebuilds its strategy). The job succeeds when the chief
    does, and fails when a slot has used its relaunches."""

    def __init__(
        self,
        job: JobMaster,
        engine: Engine,
        spec: JobSpec,
        master_addr: str,
        token: str,
        oom_policy: OomPolicy | None = None,
        relaunch_delay_s: float = 0.0,
        address_timeout_s: float = DEFAULT_ADDRESS_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        store: StateStore | None = None,
        sizer: Callable[[TfController], TfSizer] | None = None,
        worker_scaler: Callable[[TfController], TfWorkerScaler] | None = None,
        ps_scaler: Callable[[TfController], TfPsScaler] | None = None,
        supervisor: SlotSupervisor | None = None,
    ) -> None:
        """``sizer``, ``worker_scaler`` and ``ps_scaler`` build the auto-scaling parts that
        read this controller (``auto_scale``); ``supervisor`` relaunches the slots (by default
        one over ``store`` with ``oom_policy``). The controller registers itself for the whole
        job in the job's role registry."""
        if spec.tf is None:
            raise ValueError(f"job {spec.name} is not a TensorFlow job")
        self.job = job
        self.engine = engine
        self.spec = spec
        self._tf = spec.tf
        self._master_addr = master_addr
        self._token = token
        self._store = store or MemoryStateStore()
        """Where the published versions are kept (and, by the supervisor, each slot's attempt),
        so that a master restarted on its state launches the same attempts (the engine adopts
        them)."""
        self.supervisor = supervisor or SlotSupervisor(
            job.diagnostics,
            RelaunchPolicy(spec.max_relaunches, oom_policy or OomPolicy()),
            self._store,
        )
        """Decides, records and saves every slot's attempts."""
        for role in TF_ROLES:
            self.supervisor.role(role, functools.partial(self.node_spec, role))
        self._relaunch_delay_s = relaunch_delay_s
        self._address_timeout_s = address_timeout_s
        self._clock = clock
        self.slots: dict[tuple[str, int], Slot] = {}
        self._due: list[tuple[float, NodeSpec]] = []
        self.cluster_version = 0
        self.ps_generation = 0
        self._generation_nodes: tuple[str, ...] = ()
        """The ps attempts that served when the last generation was published."""
        self.relaunches: dict[str, int] = {}
        """Replacements launched, per role."""
        self.counts = {role: self._tf.count(role) for role in TF_ROLES}
        """Nodes of each role now (`request_scale` grows the ps)."""
        self._scale_requests: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        self._scaling: tuple[int, float, int] | None = None
        self._request_ids = 0
        """(ps count, when asked) of the scale-out in progress, until every new ps serves."""
        self.throughput = Throughput()
        """The job's step and sample rates, from the chief's progress reports."""
        self._raw: dict[str, bytes] = {}
        """The last report read under each key (a report is decoded once)."""
        self.sizer: TfSizer | None = None
        """Sizes the roles submitted without resources (``auto_scale``), if set."""
        self.worker_scaler: TfWorkerScaler | None = None
        """Adds and removes workers from the measured throughput (``auto_scale`` with
        ``roles.worker.max_count``), if set."""
        self.ps_scaler: TfPsScaler | None = None
        """Adds ps for a hot or saturated ps and resizes ps whose memory creeps to their limit
        (``auto_scale``), if set."""
        self._generation_cluster = 0
        """The cluster version the last ps generation was published for."""
        self.workers_changing = False
        """The worker count changed and the chief has not been told (no generation yet)."""
        self._retiring: list[NodeSpec] = []
        """Workers out of the cluster, deleted once the chief trains without them."""
        # Last: the scaling parts read this controller as they are built.
        self.sizer = sizer(self) if sizer is not None else None
        self.worker_scaler = worker_scaler(self) if worker_scaler is not None else None
        self.ps_scaler = ps_scaler(self) if ps_scaler is not None else None
        job.roles.register_job(self)

    # --- launching ----------------------------------------------------------------------------
    def node_spec(self, role: str, index: int, relaunch_count: int = 0) -> NodeSpec:
        """Slot (role, index)'s attempt, named so that it registers under the engine's id."""
        spec = self.spec.tf_node_spec(role, index, self._master_addr, self._token, relaunch_count)
        # Auto-scaled: sized (and a creeping ps resized) in place, which an unsized node allows
        # only when the engine was told at launch.
        return dataclasses.replace(
            spec, env={**spec.env, ENV_NODE_NAME: spec.node_id}, resizable=self.spec.auto_scale
        )

    def start(self) -> None:
        """Launch every node of every role at once: each slot's first attempt, or the attempt a
        master before this one launched (the engine adopts it if it still runs)."""
        now = self._clock()
        saved = self._store.get_json(_NAMESPACE, "state")
        if saved is not None:
            self.counts.update({k: int(v) for k, v in saved["counts"].items()})
            self.cluster_version = int(saved["cluster_version"])
            self.ps_generation = int(saved["ps_generation"])
            self._generation_nodes = tuple(saved["generation_nodes"])
            self._generation_cluster = int(saved.get("generation_cluster", 0))
            self.workers_changing = bool(saved.get("workers_changing", False))
            worker = functools.partial(self.node_spec, "worker")
            self._retiring = [attempt_of(worker, r) for r in saved.get("retiring", [])]
        published = TF_CLUSTER.get(self.job.kv) if saved is not None else None
        cluster = published.cluster if published else {}
        specs = []
        for role in TF_ROLES:
            for index in range(self.counts[role]):
                spec = self.supervisor.current(role, index)
                slot = Slot(role, index, spec, now)
                addresses = cluster.get(role, [])
                slot.address = addresses[index] if index < len(addresses) else ""
                self.slots[(role, index)] = slot
                specs.append(spec)
        self._save()
        counts = ", ".join(f"{self.counts[r]} {r}" for r in TF_ROLES if self.counts[r])
        logger.info(
            "launching TensorFlow job %s: %s%s",
            self.spec.name,
            counts,
            " (the attempts a master before this one launched)" if saved is not None else "",
        )
        self.job.diagnostics.event("tf", f"launching {counts}")
        # Workers removed but not deleted yet are launched by name too: the engine adopts
        # them, so that they can still be deleted once the chief trains without them.
        self.engine.launch_many(specs + self._retiring)

    def request_scale(self, role: str, count: int) -> tuple[str, int]:
        """Ask for ``count`` ps (`dlrover scale NAME --role ps --count N`): what will happen, and
        the request's id (its report on the PS_SCALE channel carries it). Raises ValueError for what
        cannot be done: other roles, fewer ps, a scaling underway."""
        if role != "ps":
            raise ValueError(
                f"role {role!r}: a TensorFlow job scales its ps on request; its workers are "
                "scaled by the auto-scaler (auto_scale: true, roles.worker.max_count)"
            )
        with self._lock:
            current = self.counts["ps"]
            if self._scaling is not None or self._scale_requests:
                raise ValueError("a ps scaling is in progress; ask again when it is done")
            if count < self.counts["ps"]:
                raise ValueError(
                    f"--count {count}: removing ps from a running TensorFlow job is not supported "
                    f"(it has {current}); only more ps"
                )
            self._request_ids += 1
            request = self._request_ids
            self._scale_requests.append((count, request))
        return (
            f"ps: scaling to {count}; the chief re-partitions the variables over them from a "
            "checkpoint"
        ), request

    def _save(self) -> None:
        """Keep the role counts and the published versions (before launching)."""
        self._store.put_json(
            _NAMESPACE,
            "state",
            {
                "counts": self.counts,
                "cluster_version": self.cluster_version,
                "ps_generation": self.ps_generation,
                "generation_nodes": list(self._generation_nodes),
                "generation_cluster": self._generation_cluster,
                "workers_changing": self.workers_changing,
                "retiring": [attempt_record(spec) for spec in self._retiring],
            },
        )

    # --- one iteration ------------------------------------------------------------------------
    def step(self, timeout_s: float) -> None:
        """Handle the engine's events that arrive within ``timeout_s``, launch the replacements
        that are due, read the nodes' registrations and publish what changed."""
        for event in self.engine.events(timeout_s):
            self.on_event(event)
        with self._lock:
            requests, self._scale_requests = self._scale_requests, []
        for count, request in requests:
            self._scale_out(count, request)
        now = self._clock()
        due = [spec for when, spec in self._due if when <= now]
        self._due = [(when, spec) for when, spec in self._due if when > now]
        if due and not self.job.lifecycle.ended.is_set():
            try:
                self.engine.launch_many(due)
            except EngineError as e:
                self.job.lifecycle.stop(f"could not relaunch TensorFlow nodes: {e}")
                return
        self._read_registrations(now)
        self._read_reports()
        self._publish_cluster()
        self._publish_ps_generation()
        if self.sizer is not None:
            self.sizer.tick()
        if self.worker_scaler is not None:
            self.worker_scaler.tick()
        if self.ps_scaler is not None and self._scaling is None:
            self.ps_scaler.tick()

    def _read_registrations(self, now: float) -> None:
        for slot in self.slots.values():
            node_id = slot.spec.node_id
            if slot.role in CLUSTER_ROLES and not slot.registered:
                address = TF_ADDRESS.get(self.job.kv, node_id)
                if address:
                    slot.registered = address
                    logger.info("tf node %s registered %s", node_id, slot.registered)
                elif (
                    now - slot.launched_at > self._address_timeout_s
                    and not self.job.lifecycle.ended.is_set()
                ):
                    self.job.lifecycle.stop(
                        f"TensorFlow node {node_id} did not register its address within "
                        f"{self._address_timeout_s:.0f}s (is dlrover-tf-node installed where it "
                        "runs? see its log)"
                    )
            serves = slot.role in ("ps", "worker") and slot.registered and not slot.serving
            if serves and TF_READY.raw(self.job.kv, node_id):
                slot.serving = True
                logger.info("tf node %s serves on %s", node_id, slot.registered)

    def _read_reports(self) -> None:
        """Take each attempt's usage report and the chief's progress, when they changed."""
        for slot in self.slots.values():
            usage = self._report(TF_USAGE, slot.spec.node_id)
            if usage is not None:
                slot.usage = usage
        progress = self._report(TF_PROGRESS)
        if progress is not None:
            self.throughput.add(progress)
            trains_without = progress.cluster_version >= self._generation_cluster > 0
            if self._retiring and trains_without and not self.workers_changing:
                retiring = [spec.node_id for spec in self._retiring]
                logger.info("the chief trains without %s: deleting", ", ".join(retiring))
                self._retiring = []
                self._save()
                try:
                    self.engine.delete_many(retiring)
                except EngineError as e:
                    logger.warning("could not delete the removed workers %s: %s", retiring, e)

    def _report(self, channel: KvChannel[R], node: str = "") -> R | None:
        """The record on ``channel`` (``node``'s) if it changed since the last read (else None);
        a record that does not decode is logged and skipped (a node of another DLRover
        version)."""
        key = channel.key_of(node)
        raw = channel.raw(self.job.kv, node)
        if raw is None or raw == self._raw.get(key):
            return None
        self._raw[key] = raw
        try:
            return channel.decode(raw)
        except MessageError as e:
            logger.warning("ignoring the report under %s: %s", key, e)
            return None

    @property
    def clock(self) -> Callable[[], float]:
        """The controller's clock (the sizer measures with it)."""
        return self._clock

    def sized(self, role: str) -> bool:
        """Whether ``role``'s nodes have a memory limit (given, or planned)."""
        return any(s.spec.resources.memory_mib for s in self.slots.values() if s.role == role)

    def trained(self) -> bool:
        """Whether the chief reported finished batches (the variables and their optimizer
        slots are on the ps by then)."""
        return self.throughput.latest is not None

    def resize_role(self, role: str, resources: Resources, reason: str) -> str:
        """Give every node of ``role`` ``resources`` (the auto-scaler's plan) and say how, for the
        plan's record. In place where the engine can: the same processes go on (no restart, no
        restore). Else each slot's next attempt replaces the current one, on its address where
        it can be bound, as after a failure (a ps: the chief restores; the chief: it resumes
        from its checkpoint); these attempts do not use up the slot's max_relaunches."""
        slots = [s for s in self.slots.values() if s.role == role and not s.ended]
        # A replacement not launched yet starts at the new size.
        due = {spec.node_id for _, spec in self._due if spec.role == role}
        self._due = [
            (when, dataclasses.replace(spec, resources=resources) if spec.node_id in due else spec)
            for when, spec in self._due
        ]
        for slot in slots:
            if slot.spec.node_id in due:
                slot.spec = dataclasses.replace(slot.spec, resources=resources)
                self.supervisor.keep(slot.spec)
        outcome = resize_in_place(
            self.engine, [s.spec for s in slots if s.spec.node_id not in due], resources
        )
        for slot in slots:
            if slot.spec.node_id in outcome.in_place:
                slot.spec = outcome.in_place[slot.spec.node_id]
                self.supervisor.keep(slot.spec)
        if outcome.in_place:
            nodes = ", ".join(outcome.in_place)
            logger.info("resized the %s nodes in place (%s): %s", role, reason, nodes)
            self.job.diagnostics.event("tf", f"resizing {role}: in place {nodes}")
        self._relaunch_at(role, [s for s in slots if s.spec.node_id in outcome.relaunch], resources)
        return outcome.describe()

    def _relaunch_at(self, role: str, slots: list[Slot], resources: Resources) -> None:
        """Relaunch ``slots`` with ``resources`` (their engine cannot resize them in place)."""
        now = self._clock()
        old, new = [], []
        for slot in slots:
            # Saved before launching: a restarted master launches these attempts too.
            spec = self.supervisor.replace(slot.spec, resources)
            assert spec is not None  # a planned replacement always has one
            old.append(slot.spec.node_id)
            new.append(spec)
            slot.spec, slot.registered, slot.serving, slot.usage = spec, "", False, None
            slot.launched_at = now
        if not new:
            return
        logger.info("relaunching the %s nodes at their new size: %s", role, ", ".join(old))
        self.job.diagnostics.event(
            "tf", f"resizing {role}: relaunching {', '.join(s.node_id for s in new)}"
        )
        try:
            self.engine.delete_many(old)
            self.engine.launch_many(new)
        except EngineError as e:
            self.job.lifecycle.stop(f"could not relaunch the {role} nodes at their new size: {e}")

    def role_resources(self, role: str) -> Resources:
        """What one node of ``role`` asks for now (its first slot's current attempt)."""
        specs = [s.spec for s in self.slots.values() if s.role == role]
        return specs[0].resources if specs else Resources()

    def settled(self) -> bool:
        """Whether every role is sized (or given its size) and every ps and worker serves."""
        sized = self.sizer is None or all(r.role in self.sizer.sized for r in self.role_nodes())
        return sized and all(s.serving for s in self.slots.values() if s.role in ("ps", "worker"))

    def scale_workers(self, count: int) -> None:
        """Run ``count`` workers (the auto-scaler's plan). New slots are launched and join the
        cluster once they serve: a new cluster version and ps generation, on which the chief
        starts again from a checkpoint (as for more ps). Removed ones leave the cluster at once
        and are deleted only once the chief trains without them, so no step of theirs is cut
        off after its updates reached the ps (it would be run again: samples twice)."""
        before = self.counts["worker"]
        if count == before or count < 1:
            return
        now = self._clock()
        specs = []
        for index in range(before, count):
            # A slot used before gets its next attempt (a new name) and its whole budget.
            spec = self.supervisor.open("worker", index, fresh=True)
            self.slots[("worker", index)] = Slot("worker", index, spec, now)
            specs.append(spec)
        for index in range(count, before):
            self._retiring.append(self.slots.pop(("worker", index)).spec)
        self.counts["worker"] = count
        self.workers_changing = True
        self._save()  # before launching: a restarted master launches these attempts too
        logger.info("scaling the workers from %d to %d", before, count)
        self.job.diagnostics.event("scale", f"worker {before} -> {count}")
        try:
            self.engine.launch_many(specs)
        except EngineError as e:
            self.job.lifecycle.stop(f"could not launch the new workers: {e}")

    def rates(self) -> Rates:
        """The job's step and sample rates lately."""
        return self.throughput.rates()

    def role_nodes(self) -> list[RoleNode]:
        """Every slot's current attempt: state, relaunches, usage, memory limit."""
        order = sorted(self.slots, key=lambda key: (TF_ROLES.index(key[0]), key[1]))
        return [self.slots[key].role_node() for key in order]

    def _scale_out(self, count: int, request: int) -> None:
        before = self.counts["ps"]
        if count <= before:
            PS_SCALE.put(self.job.kv, ScaleReport("scale", before, request=request, tf=True))
            return
        now = self._clock()
        specs = [self.supervisor.open("ps", index) for index in range(before, count)]
        for spec in specs:
            self.slots[("ps", spec.rank)] = Slot("ps", spec.rank, spec, now)
        self.counts["ps"] = count
        self._scaling = (count, now, request)
        self._save()
        logger.info("scaling the ps from %d to %d", before, count)
        self.job.diagnostics.event("scale", f"ps {before} -> {count}")
        try:
            self.engine.launch_many(specs)
        except EngineError as e:
            self.job.lifecycle.stop(f"could not launch the new ps: {e}")

    def cluster(self) -> dict[str, list[str]] | None:
        """The cluster spec of the registered addresses, or None while a slot has none."""
        cluster: dict[str, list[str]] = {}
        for role in CLUSTER_ROLES:
            addresses = [self.slots[(role, i)].registered for i in range(self.counts[role])]
            if not all(addresses):
                return None
            if addresses:
                cluster[role] = addresses
        return cluster

    def _publish_cluster(self) -> None:
        cluster = self.cluster()
        if cluster is None:
            return
        published = {
            role: [self.slots[(role, i)].address for i in range(len(addresses))]
            for role, addresses in cluster.items()
        }
        # Fewer workers leave every remaining address as published: the count changed.
        shrunk = self.workers_changing and self.cluster_version == self._generation_cluster
        if cluster == published and self.cluster_version and not shrunk:
            return
        self.cluster_version += 1
        for slot in self.slots.values():
            if slot.role in CLUSTER_ROLES:
                slot.address = slot.registered
        spec = TfCluster(self.cluster_version, cluster)
        TF_CLUSTER.put(self.job.kv, spec, version=self.cluster_version)
        self._save()
        logger.info("cluster spec version %d: %s", self.cluster_version, json.dumps(cluster))
        self.job.diagnostics.event("tf", f"cluster spec version {self.cluster_version}")
        self.job.lifecycle.mark_running(f"cluster spec version {self.cluster_version} published")

    def _publish_ps_generation(self) -> None:
        ps = [self.slots[("ps", i)] for i in range(self.counts["ps"])]
        if not self.cluster_version or not all(s.serving for s in ps):
            return
        nodes = tuple(s.spec.node_id for s in ps)
        workers = [self.slots[("worker", i)] for i in range(self.counts["worker"])]
        # A changed worker count is told to the chief as a generation too, once every worker
        # of the new cluster serves (the chief builds over it and would wait for them).
        new_workers = self.workers_changing and self.cluster_version != self._generation_cluster
        if new_workers and not all(s.serving for s in workers):
            return
        if nodes == self._generation_nodes and not new_workers:
            return
        self._generation_nodes = nodes
        self._generation_cluster = self.cluster_version
        self.workers_changing = False
        self.ps_generation += 1
        generation = PsGeneration(self.ps_generation, self.cluster_version)
        TF_PS_GENERATION.put(self.job.kv, generation, version=self.ps_generation)
        self._save()
        logger.info("ps generation %d: %s serve", self.ps_generation, ", ".join(nodes))
        self.job.diagnostics.event("tf", f"ps generation {self.ps_generation}: every ps serves")
        if self._scaling is not None:
            count, asked, request = self._scaling
            self._scaling = None
            seconds = self._clock() - asked
            report = ScaleReport("scale", count, request=request, tf=True, seconds=seconds)
            PS_SCALE.put(self.job.kv, report)
            logger.info("%d ps serve, %.1fs after the request", count, seconds)

    # --- events -------------------------------------------------------------------------------
    def on_event(self, event: NodeEvent) -> None:
        """An engine event of one of the job's nodes: the chief's success ends the job, a
        current attempt's failure is relaunched (or ends the job) as the relaunch policy says."""
        logger.info("engine: %s", event)
        slot = self.slots.get((event.spec.role, event.spec.rank))
        if slot is None or slot.spec.node_id != event.node_id or self.job.lifecycle.ended.is_set():
            return  # an attempt replaced already, or the job is over
        if event.state is NodeState.SUCCEEDED:
            slot.ended = "succeeded"
            if slot.role == "chief":
                self.job.lifecycle.succeed(f"the chief {event.node_id} succeeded")
            else:
                logger.info("tf node %s (%s) ended", event.node_id, slot.role)
            return
        if event.state is NodeState.FAILED:
            self._relaunch(slot, event)

    def _relaunch(self, slot: Slot, event: NodeEvent) -> None:
        why = event.message or (event.reason.value if event.reason else "failed")
        cannot_start = event.exit_code == CANNOT_START_EXIT_CODE
        cause = (TF_START_ERROR.get(self.job.kv, event.node_id) or "") if cannot_start else ""
        verdict = self.supervisor.judge(event, label=slot.role, cause=cause)
        spec = verdict.replacement
        if spec is None and cannot_start:
            slot.ended = "failed"
            self.job.lifecycle.stop(f"TensorFlow {verdict.reason}")
            return
        if spec is None:
            history = (
                f"; OOM-killed with {', '.join(f'{m} MiB' for m in verdict.oom_kills)}: give "
                f"roles.{slot.role}.resources more memory"
                if verdict.oom_kills
                else ""
            )
            limit = (
                f"cannot grow: the memory cap is {self.supervisor.policy.oom.max_memory_mib} MiB"
                if verdict.cannot_grow
                else f"used its {self.spec.max_relaunches} relaunches"
            )
            slot.ended = "failed"
            self.job.lifecycle.stop(
                f"TensorFlow {slot.role} {slot.index} ({event.node_id}) {limit}{history}"
            )
            return
        if spec.resources != event.spec.resources:
            logger.info(
                "tf node %s failed (%s); launching %s with %d MiB",
                event.node_id,
                why,
                spec.node_id,
                spec.resources.memory_mib,
            )
        else:
            logger.info("tf node %s failed (%s); launching %s", event.node_id, why, spec.node_id)
        self.job.diagnostics.event(
            "tf", f"{event.node_id} failed ({why}): relaunching as {spec.node_id}"
        )
        slot.spec = spec
        slot.registered = ""
        slot.serving = False
        slot.usage = None
        slot.launched_at = self._clock() + self._relaunch_delay_s
        self.relaunches[slot.role] = self.relaunches.get(slot.role, 0) + 1
        self._due.append((self._clock() + self._relaunch_delay_s, spec))

    # --- the loop -----------------------------------------------------------------------------
    def run(
        self,
        stop: threading.Event,
        poll_s: float = 0.2,
        delete_nodes: Callable[[], bool] = lambda: True,
    ) -> None:
        """Drive the controller until the job ends or `stop` is set; then remove every node
        (unless ``delete_nodes()`` says no)."""
        try:
            while not self.job.lifecycle.ended.is_set() and not stop.is_set():
                self.step(poll_s)
        finally:
            self.engine.close(delete_nodes=delete_nodes())
