"""The job master: the job's lifecycle over its parts (membership, diagnostics, pre-flight, roles).

Each part is its own module and imports none of the others nor this one; the job wires their
listeners together and is what the RPC layer (server.py, local_api.py) calls:

- `Membership` (membership.py): node table, heartbeats, rendezvous rounds, the one `lose`;
- `Diagnostics` (diagnostics.py): failure log, runtime stragglers, goodput, timeline;
- `Preflight` (preflight.py): the node check of each round;
- `RoleRegistry` (roles.py): each role's controller, which relaunches through the one
  `RelaunchPolicy` (relaunch_policy.py);
- the key-value store, dynamic sharding and checkpoint commit votes.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from dlrover.api.master import (
    FailureClass,
    FailureRecord,
    NodeCheckJoin,
    NodeCheckReport,
    NodeCheckTask,
)
from dlrover.checkpoint.coordinator import CommitVotes
from dlrover.constants import DEFAULT_HEARTBEAT_TIMEOUT_S, HEARTBEATS_PER_S_BUDGET
from dlrover.master.diagnostics import MAX_EVENTS, Diagnostics
from dlrover.master.goodput import StepSample
from dlrover.master.kv_store import KvStore
from dlrover.master.membership import NAMESPACE as _NAMESPACE
from dlrover.master.membership import Membership
from dlrover.master.nodes import Node, NodeError, NodeState
from dlrover.master.preflight import Preflight
from dlrover.master.ps_load import Rates
from dlrover.master.rendezvous import RendezvousConfig, RendezvousError, RendezvousManager, World
from dlrover.master.roles import (
    EmbeddingServers,
    MeasuresThroughput,
    RoleController,
    RoleNode,
    RoleRegistry,
    ShowsNodes,
)
from dlrover.master.sharding_service import ShardingService
from dlrover.master.state_store import StateStore
from dlrover.master.stragglers import DEFAULT_REPORT_S, Score

__all__ = ["MAX_EVENTS", "JobMaster", "JobMasterConfig", "JobState"]

logger = logging.getLogger(__name__)


class JobState(str, enum.Enum):
    """Lifecycle of the job.

    Legal transitions: PENDING -> RUNNING (first round closed; in a TensorFlow job, its first
    cluster spec published) -> SUCCEEDED | FAILED;
    PENDING -> FAILED (e.g. every node lost before the first round).
    """

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(frozen=True)
class JobMasterConfig:
    """What the master is started with."""

    job_name: str = "none"
    rendezvous: RendezvousConfig | None = None
    """None: the first agent that registers fixes min/max nodes from its --nnodes."""
    heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S
    """A node with no heartbeat for this long is lost (stretched with the heartbeat interval in
    big jobs: at least 3 intervals)."""
    heartbeats_per_s: float = HEARTBEATS_PER_S_BUDGET
    """The heartbeat budget of the whole job: agents are told to beat at most every
    nodes / budget seconds."""
    straggler_report_s: float = DEFAULT_REPORT_S
    """How often nodes' step times are scored (dlrover/master/stragglers.py)."""
    exclude_stragglers: bool = False
    """Replace a node that stays a runtime straggler (needs an engine: `take_replacements`)."""


class JobMaster:
    """The single source of truth of one job. Thread-safe (one lock, shared by its parts);
    `tick()` advances time-based work.

    Long polls wait on three change feeds: `rounds` (a round closed, the job ended) for nodes
    waiting to join, `membership` (also joins and departures) for running nodes watching
    whether their world must re-form, and `checks` for the node check. A join does not wake the
    nodes waiting for the round, so forming a round of N nodes costs O(N) wake-ups, not O(N^2).
    """

    def __init__(
        self,
        config: JobMasterConfig,
        store: StateStore,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._clock = clock
        self._store = store
        self._lock = threading.RLock()
        saved = store.get_json(_NAMESPACE, "state") or {}
        self.state = JobState(saved.get("state", JobState.PENDING.value))
        self.reason: str = saved.get("reason", "")
        self.exit_code: int = saved.get("exit_code", 0)
        self.ended = threading.Event()
        if self.state in (JobState.SUCCEEDED, JobState.FAILED):
            self.ended.set()
        self.members = Membership(
            store,
            clock,
            self._lock,
            self.ended,
            config.heartbeat_timeout_s,
            config.heartbeats_per_s,
            config.rendezvous,
            ended_why=lambda: self.state.value,
        )
        self.diagnostics = Diagnostics(
            store, clock, self._lock, config.straggler_report_s, self._restarts_of
        )
        self.preflight = Preflight(
            clock,
            self._lock,
            self.members.world,
            self._ended_as,
            self._exclude_checked,
            self._keep_checked,
        )
        self.roles = RoleRegistry()
        """Each role's controller (`scale_role` asks it; the node controller routes events)."""
        self._ps: EmbeddingServers | None = None
        self.kv = KvStore(store)
        self.sharding = ShardingService(store, clock)
        self.checkpoint = CommitVotes(
            committed=int(store.get_json("checkpoint", "committed") or -1),
            on_committed=self._on_committed,
        )
        self._metrics_port = 0
        self._tick_hooks: list[Callable[[float], None]] = []
        # The parts' state as the RPC layer, the metrics and the dashboard read it.
        self.nodes = self.members.nodes
        self.rounds = self.members.rounds
        self.membership = self.members.changes
        self.checks = self.preflight.checks
        self.check_words = self.preflight.words
        self.stragglers = self.diagnostics.stragglers
        self.goodput = self.diagnostics.goodput
        self.events = self.diagnostics.events
        self.members.on_round.append(self._on_round)
        self.members.on_lost.append(self._on_lost)
        self.members.on_rejoin.append(self.sharding.recover_node)
        if self.members.activated_round:
            # A round formed under a master before this one: its workers kept training, and
            # their steps since this master started count (counted from this master).
            self.goodput.on_round(clock(), self.members.activated_round, resumed=True)

    @property
    def rendezvous(self) -> RendezvousManager | None:
        """The job's rendezvous (None until the first registration fixes the node range)."""
        return self.members.rendezvous

    @property
    def scale_summary(self) -> str:
        """The auto-scaler's latest plan in one line (`dlrover status`)."""
        return self.diagnostics.scale_summary

    @property
    def check_summary(self) -> str:
        """The latest node check's verdict in one line (`dlrover status`)."""
        return self.preflight.summary

    # --- wiring of the parts -------------------------------------------------------------------
    def _restarts_of(self, node_id: str) -> int:
        try:
            return self.nodes.get(node_id).restart_count
        except NodeError:
            return 0

    def _ended_as(self) -> str | None:
        return self.state.value if self.ended.is_set() else None

    def _on_round(self, world: World) -> None:
        """A round closed (under the lock): goodput, the timeline, and the job is RUNNING."""
        self.goodput.on_round(self._clock(), world.round)
        self.event(
            "round", f"round {world.round}: {len(world.members)} nodes, world size "
            f"{world.world_size}"
        )  # fmt: skip
        if self.state == JobState.PENDING:
            self._set_job_state(JobState.RUNNING, f"round {world.round} formed")

    def _on_lost(self, node_id: str, cause: str, alive: bool, silent: bool) -> None:
        """A node left (`Membership.lose`): what every other part forgets or records of it."""
        if silent:
            self.diagnostics.record(node_id, FailureClass.NODE_LOST, "drop", cause)
        elif alive:
            self.event("node", f"{node_id} lost: {cause}")
        self.preflight.node_left(node_id, "lost" if silent else cause)
        self.diagnostics.forget(node_id)
        self.sharding.recover_node(node_id)

    def _exclude_checked(self, node_id: str, cls: FailureClass, cause: str, summary: str) -> None:
        """The node check excluded ``node_id``: recorded, and the node is lost."""
        self.diagnostics.record(node_id, cls, "exclude", cause)
        self.node_lost(node_id, f"excluded by the node check: {summary}")

    def _keep_checked(self, node_id: str, cause: str) -> None:
        """The node check named ``node_id`` a straggler and keeps it: recorded all the same."""
        self.diagnostics.record(
            node_id, FailureClass.STRAGGLER, "none", f"{cause}; kept (no --exclude-straggler)"
        )

    def _on_committed(self, step: int) -> None:
        self._store.put_json("checkpoint", "committed", step)
        self.event("ckpt", f"checkpoint of step {step} committed to storage")

    # --- registration and liveness -----------------------------------------------------------
    def register(
        self,
        node_id: str,
        host: str,
        role: str,
        local_world_size: int,
        requested_rank: int,
        pid: int,
        rdzv: RendezvousConfig | None,
    ) -> Node:
        """Register a node: a new one, or a known id again with a bumped incarnation. The first
        registration must carry ``rdzv`` and fixes the node range; a later ``rdzv`` with other
        min/max nodes raises RendezvousError."""
        return self.members.register(
            node_id, host, role, local_world_size, requested_rank, pid, rdzv, self.config.job_name
        )

    def heartbeat_interval_s(self) -> float:
        """The shortest heartbeat interval the job's size allows: live nodes / the budget (an
        agent beats at the larger of this and its own interval)."""
        return self.members.heartbeat_interval_s()

    def heartbeat_timeout_s(self) -> float:
        """Silence after which a node is lost: the configured timeout, or 3 times the longest
        interval recently told to a node (a shrinking job must not lose the nodes that were told
        to beat rarely)."""
        return self.members.heartbeat_timeout_s()

    def heartbeat(
        self,
        node_id: str,
        incarnation: int,
        step: int,
        cpu: float,
        mem: int,
        restarts: int,
        step_time_s: float = 0.0,
        sample: StepSample | None = None,
        breakdown: tuple[float, float, float] | None = None,
        persist_s: float = 0.0,
        worker_pids: tuple[int, ...] | None = None,
    ) -> str:
        """Record liveness (and the node's step time for straggler scores, its workers' step
        for goodput); returns the action for the agent ("", "stop" or "reregister")."""
        state = self.nodes.record_heartbeat(
            node_id, incarnation, step, cpu, mem, restarts, breakdown, persist_s, worker_pids
        )
        world = self.members.world()
        if sample is not None and world is not None and world.member(node_id) is not None:
            self.goodput.on_progress(self._clock(), world.round, sample)
        if step_time_s > 0:
            self.diagnostics.observe_step_time(node_id, step_time_s)
        if state == NodeState.LOST:
            # A node that was presumed lost is heard again: it must re-register.
            return "reregister"
        return "stop" if self.ended.is_set() else ""

    def report_step(self, node_id: str, step: int) -> None:
        """Record a step a training process of ``node_id`` finished (also a sign of life). Raises
        UnknownNodeError."""
        self.nodes.record_step(node_id, step)

    def expect(self, node_id: str) -> None:
        """A node controller launched ``node_id`` to replace a lost node: until it registers,
        or is lost itself, the job does not fail for having no live node."""
        self.members.expect(node_id)

    def unexpect(self, node_id: str) -> None:
        """The replacement `expect` announced will not be launched after all."""
        self.members.unexpect(node_id)

    def node_lost(self, node_id: str, reason: str) -> None:
        """An engine (or a controller) says the node's process is gone: drop it now, not at the
        heartbeat timeout (`Membership.lose`)."""
        self.members.lose(node_id, reason)

    # --- rendezvous --------------------------------------------------------------------------
    def rendezvous_config(self) -> RendezvousConfig:
        """The job's node range, fixed by the first registration."""
        return self.members.rdzv().config

    def now(self) -> float:
        """The master's clock (monotonic seconds; injectable for tests)."""
        return self._clock()

    def join(
        self,
        node_id: str,
        incarnation: int,
        local_world_size: int,
        store_host: str,
        store_port: int,
    ) -> int:
        """Put the node into the next rendezvous round and return its number; a running or lost
        node goes back to PENDING, and shards its workers held go back to the queues. Raises
        NodeError for a stale incarnation, RendezvousError once the job has ended; a round that
        can never close (`Membership.unformable`) fails the job."""
        round = self.members.join(node_id, incarnation, local_world_size, store_host, store_port)
        self._fail_if_unformable()
        return round

    def _fail_if_unformable(self) -> None:
        with self._lock:
            why = self.members.unformable()
            if why:
                self._fail(why, 1)

    def close_deadline(self) -> float | None:
        """When the waiting round's last call ends (master clock), or None if none is due."""
        return self.rendezvous.close_deadline() if self.rendezvous is not None else None

    def get_world(self, node_id: str, incarnation: int) -> World | None:
        """The node's world once its round has closed, else None. A closed round's pending
        members become RUNNING, and a pending job too; ``incarnation`` 0 skips the incarnation
        check."""
        return self.members.get_world(node_id, incarnation)

    def lost_join(self, node_id: str, round: int) -> bool:
        """Whether the node's join for ``round`` is unknown here (see RendezvousManager)."""
        return self.members.rdzv().lost_join(node_id, round)

    def num_nodes_waiting(self, node_id: str, round: int) -> tuple[int, int]:
        """(waiting nodes that should make the running world re-form, the latest round); also a sign
        of life of the node."""
        self.nodes.touch(node_id)
        return self.members.rdzv().num_nodes_waiting(node_id, round)

    # --- roles -------------------------------------------------------------------------------
    def scale_role(self, role: str, count: int) -> tuple[str, int]:
        """Ask for ``count`` nodes of ``role`` (`dlrover scale`): what will happen, and the
        request's id its report will carry. Raises ValueError for a role that cannot be scaled
        so."""
        controller = self.roles.get(role)
        if controller is not None:
            return controller.request_scale(role, count)
        if role != "ps":
            raise ValueError(
                f"role {role!r}: only ps (embedding servers) is scaled on request; workers scale "
                "within --nnodes MIN:MAX (dlrover submit --auto-scale)"
            )
        raise ValueError(
            f"job {self.config.job_name} has no embedding servers (roles.ps in the job spec, "
            "or dlrover submit --ps N)"
        )

    @property
    def ps(self) -> EmbeddingServers | None:
        """The embedding servers' controller, in a job with a ps role (metrics, status);
        setting it registers it for role ``ps``."""
        return self._ps

    @ps.setter
    def ps(self, controller: EmbeddingServers | None) -> None:
        self._ps = controller
        self.roles.register("ps", controller)

    @property
    def tf(self) -> RoleController | None:
        """The controller of a TensorFlow parameter-server job (every role); setting it
        registers it for the whole job."""
        return self.roles.whole_job()

    @tf.setter
    def tf(self, controller: RoleController | None) -> None:
        self.roles.register_job(controller)

    def role_nodes(self) -> list[RoleNode]:
        """The nodes role controllers drive beside the agents of the node table (a TensorFlow
        job's every role, embedding servers): what status, /metrics and the dashboard add."""
        rows: list[RoleNode] = []
        for controller in self.roles.controllers():
            if isinstance(controller, ShowsNodes):
                rows.extend(controller.role_nodes())
        return rows

    def rates(self) -> Rates:
        """The job's step and sample rates lately, where a role controller measures them (a
        TensorFlow job's chief reports its progress); zeros otherwise."""
        controller = self.tf
        return controller.rates() if isinstance(controller, MeasuresThroughput) else Rates()

    # --- diagnosis ---------------------------------------------------------------------------
    def event(self, kind: str, text: str) -> None:
        """Add ``text`` to the timeline (kinds: round, failure, job, scale, node, ckpt)."""
        self.diagnostics.event(kind, text)

    def record_failure(self, record: FailureRecord) -> None:
        """Keep a classified failure (in the state: it outlives the master) and log it."""
        self.diagnostics.record_failure(record)

    def failures(self) -> tuple[FailureRecord, ...]:
        """Every failure kept, oldest first."""
        return self.diagnostics.failures()

    def straggler_scores(self) -> dict[str, Score]:
        """A copy of the latest straggler report's scores by node (the tick and departures
        change them under the job's lock)."""
        return self.diagnostics.straggler_scores()

    def take_replacements(self) -> list[tuple[str, str]]:
        """(node, why) to replace as stragglers since the last call: the node controller
        deletes each and launches its slot's next attempt, or keeps it (`keep_straggler`)."""
        return self.diagnostics.take_replacements()

    def keep_straggler(self, node_id: str, cause: str) -> None:
        """The controller could not replace ``node_id``: it stays (and may register again)."""
        self.members.readmit(node_id)
        self.diagnostics.record(
            node_id, FailureClass.STRAGGLER, "none", f"{cause}; kept: no relaunch left"
        )

    # --- the pre-flight node check ----------------------------------------------------------
    def join_node_check(self, join: NodeCheckJoin) -> None:
        """A node is ready for a round of the node check of its rendezvous round (see
        dlrover/master/node_check.py). The check starts with the first join of a closed round's
        member; a join for an older rendezvous round is answered REFORM by `node_check_task`."""
        self.nodes.get(join.node_id, join.incarnation)
        self.nodes.touch(join.node_id)
        self.preflight.join(join)

    def node_check_task(
        self, node_id: str, rdzv_round: int, check_round: int
    ) -> NodeCheckTask | None:
        """What the node must do for ``check_round``; None while the round waits for members."""
        return self.preflight.task(node_id, rdzv_round, check_round)

    def report_node_check(self, report: NodeCheckReport) -> None:
        """Record a node's result of a check round."""
        self.nodes.get(report.node_id, report.incarnation)
        self.nodes.touch(report.node_id)
        self.preflight.report(report)

    def node_check_deadline(self) -> float | None:
        """When the running check round times out (master clock), or None."""
        return self.preflight.deadline()

    # --- the end -----------------------------------------------------------------------------
    def report_node_status(
        self, node_id: str, incarnation: int, status: str, exit_code: int, reason: str
    ) -> bool:
        """An agent finished. Returns True once the job has succeeded (the exit barrier)."""
        self.nodes.get(node_id, incarnation)
        with self._lock:
            if status == "succeeded":
                self.nodes.set_state(node_id, NodeState.SUCCEEDED, reason or "workers succeeded")
                self._check_success()
                self._fail_if_unformable()
            elif status == "failed":
                self.nodes.set_state(node_id, NodeState.FAILED, reason or "workers failed")
                self.nodes.set_exit_code(node_id, exit_code)
                self._fail(f"node {node_id} failed: {reason}", exit_code or 1)
            else:
                raise RendezvousError(f"unknown node status {status!r}: use succeeded or failed")
            return self.state == JobState.SUCCEEDED

    def _check_success(self) -> None:
        world = self.members.world()
        if world is None or self.ended.is_set():
            return
        if self.nodes.count(NodeState.SUCCEEDED) < len(world.members):
            return  # not yet: the scan below is O(nodes), this count O(1)
        states = [self.nodes.get(m.node_id).state for m in world.members]
        if all(s == NodeState.SUCCEEDED for s in states):
            self._succeed(f"all {len(states)} nodes succeeded")

    def _succeed(self, reason: str) -> None:
        self._set_job_state(JobState.SUCCEEDED, reason)
        self.exit_code = 0
        self._end()

    def _fail(self, reason: str, exit_code: int) -> None:
        if self.ended.is_set():
            return
        self.exit_code = exit_code
        self._set_job_state(JobState.FAILED, reason)
        self._end()
        self.checks.bump()  # a node check in progress ends with the job

    def _end(self) -> None:
        self._save()
        self.goodput.on_end(self._clock())
        self.ended.set()
        self.rounds.bump()
        self.membership.bump()

    def stop(self, reason: str) -> None:
        """End the job from outside (e.g. SIGTERM to the master)."""
        with self._lock:
            self._fail(reason, 1)

    def mark_running(self, reason: str) -> None:
        """PENDING -> RUNNING from outside: a job without rounds (TensorFlow) started."""
        with self._lock:
            if self.state is JobState.PENDING and not self.ended.is_set():
                self._set_job_state(JobState.RUNNING, reason)

    def succeed(self, reason: str) -> None:
        """End the job as succeeded from outside: a job whose end is one node's, not its
        agents' exit barrier (the chief of a TensorFlow job, dlrover/master/tf_controller.py)."""
        with self._lock:
            if not self.ended.is_set():
                self._succeed(reason)

    def tick(self) -> None:
        """Time-based work: lose nodes whose heartbeats stopped, close a round whose last call
        passed; then run the tick hooks."""
        self.members.lose_silent(self.heartbeat_timeout_s())
        self.sharding.tick()
        self.goodput.sample(self._clock(), time.time())
        self.preflight.tick()
        with self._lock:
            if self.stragglers.due():
                self._score_stragglers()
        self.members.close_round_if_due()
        with self._lock:
            if (
                not self.ended.is_set()
                and not self.members.expecting()  # no replacement is on its way
                and self.members.alive() == 0
                and self.nodes.count(NodeState.LOST) > 0
            ):
                self._fail("every node was lost", 1)
            elif not self.ended.is_set() and self.state == JobState.RUNNING:
                self._check_success()
                self._fail_if_unformable()
        # Last, each on its own: an exporter's failure (a full disk) must not skip the job's work.
        for hook in list(self._tick_hooks):
            try:
                hook(self._clock())
            except Exception:
                logger.exception("tick hook %r failed", hook)

    def _score_stragglers(self) -> None:
        """A straggler report over the running members of the current round; a node queued for
        replacement may not register again."""
        world = self.members.world()
        if world is None or self.ended.is_set():
            return
        states = {m.node_id: self.nodes.get(m.node_id).state for m in world.members}
        if NodeState.SUCCEEDED in states.values():
            # The round is finishing: a node replaced now could never rejoin it (the succeeded
            # ones do not), so the replacement would strand the job instead of speeding it up.
            return
        running = [node for node, state in states.items() if state == NodeState.RUNNING]
        for node in self.diagnostics.score_stragglers(running, self.config.exclude_stragglers):
            self.members.exclude(node)

    @property
    def metrics_port(self) -> int:
        """Where /metrics and the dashboard are served (0: nowhere)."""
        return self._metrics_port

    def serve_metrics_on(self, port: int) -> None:
        """Say that /metrics and the dashboard are served on ``port`` (job status reports it)."""
        self._metrics_port = port

    def add_tick_hook(self, hook: Callable[[float], None]) -> None:
        """Call ``hook`` with the master's time at the end of every `tick` (the TensorBoard
        exporter); one that raises is logged and does not stop the tick or the other hooks."""
        self._tick_hooks.append(hook)

    def _set_job_state(self, new: JobState, reason: str) -> None:
        logger.info(
            "job %s: %s -> %s (%s)", self.config.job_name, self.state.value, new.value, reason
        )
        self.state = new
        self.reason = reason
        self.event("job", f"{new.value}: {reason}")
        self._save()

    def _save(self) -> None:
        self._store.put_json(
            _NAMESPACE,
            "state",
            {"state": self.state.value, "reason": self.reason, "exit_code": self.exit_code},
        )
