"""The job master's state machine: node table, rendezvous, key-value store and the job's end."""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from dlrover.api.master import (
    FailureClass,
    FailureRecord,
    NodeCheckJoin,
    NodeCheckReport,
    NodeCheckState,
    NodeCheckTask,
)
from dlrover.checkpoint.coordinator import CommitVotes
from dlrover.constants import DEFAULT_HEARTBEAT_TIMEOUT_S, HEARTBEATS_PER_S_BUDGET
from dlrover.master import diagnosis
from dlrover.master.changes import ChangeFeed
from dlrover.master.goodput import GoodputTracker, StepSample
from dlrover.master.kv_store import KvStore
from dlrover.master.node_check import CheckResult, CheckSettings, NodeCheck
from dlrover.master.nodes import ALIVE_STATES, Node, NodeError, NodeState, NodeTable
from dlrover.master.rendezvous import RendezvousConfig, RendezvousError, RendezvousManager, World
from dlrover.master.roles import EmbeddingServers, RoleController, RoleRegistry
from dlrover.master.sharding_service import ShardingService
from dlrover.master.state_store import StateStore
from dlrover.master.stragglers import DEFAULT_REPORT_S, Score, StragglerWatch

logger = logging.getLogger(__name__)

MAX_EVENTS = 500
"""Timeline events kept (`JobMaster.events`)."""

_NAMESPACE = "job"


def _restored_rendezvous(
    store: StateStore, given: RendezvousConfig | None
) -> RendezvousConfig | None:
    """The node range of this job: the one a previous master of it saved, else ``given``.

    Raises RendezvousError when both exist and differ (a restarted master must keep the job's
    --nnodes, or start on a new state file).
    """
    saved = store.get_json(_NAMESPACE, "rendezvous")
    if saved is None:
        return given
    try:
        restored = RendezvousConfig(**saved)
    except TypeError as e:
        raise RendezvousError(f"the saved node range {saved!r} is not readable ({e})") from None
    if given is not None and given != restored:
        raise RendezvousError(
            f"this job's state has --nnodes {restored.min_nodes}:{restored.max_nodes} "
            f"(node unit {restored.node_unit}) but the master was started with "
            f"{given.min_nodes}:{given.max_nodes} (node unit {given.node_unit}); restart it with "
            "the job's range, or give it a new --state-db for a new job"
        )
    return restored


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
    """The single source of truth of one job. Thread-safe; `tick()` advances time-based work.

    Long polls wait on two change feeds: `rounds` (a round closed, the job ended) for nodes
    waiting to join, and `membership` (also joins and departures) for running nodes watching
    whether their world must re-form. A join does not wake the nodes waiting for the round, so
    forming a round of N nodes costs O(N) wake-ups, not O(N^2).
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
        self.nodes = NodeTable(store, clock)
        self.kv = KvStore(store)
        self.sharding = ShardingService(store, clock)
        self.checkpoint = CommitVotes(
            committed=int(store.get_json("checkpoint", "committed") or -1),
            on_committed=self._on_committed,
        )
        self.rendezvous: RendezvousManager | None = None
        self.rounds = ChangeFeed()
        self.membership = ChangeFeed()
        self.checks = ChangeFeed()
        """Bumped when a node check pairs a round, decides or is abandoned (its joins wait on
        it); not on every join, so a round of N nodes costs O(N) wake-ups."""
        self._check: NodeCheck | None = None
        self._checked: set[str] = set()
        """Nodes that passed a node check (a later round checks only if a member is new)."""
        self.check_words: dict[str, str] = {}
        """node id -> the node check's word on it (`dlrover status`)."""
        self.check_summary = ""
        saved_failures = diagnosis.load_failures(store)
        self._failures = [record for _, record in saved_failures]
        self._failure_seq = saved_failures[-1][0] if saved_failures else 0
        self.stragglers = StragglerWatch(clock, config.straggler_report_s)
        self.goodput = GoodputTracker(clock())
        """Live goodput and badput (metrics, dashboard, status)."""
        self._replace: list[tuple[str, str]] = []
        self.scale_summary = ""
        """The auto-scaler's latest plan in one line (`dlrover status`)."""
        self.roles = RoleRegistry()
        """Each role's controller (`scale_role` asks it; the node controller routes events)."""
        self._ps: EmbeddingServers | None = None
        self.metrics_port = 0
        """Where /metrics and the dashboard are served (0: nowhere)."""
        self.tick_hooks: list[Callable[[float], None]] = []
        """Called with the master's time at the end of every `tick` (the TensorBoard exporter);
        one that raises is logged and does not stop the tick or the other hooks."""
        self.events: deque[tuple[float, str, str]] = deque(maxlen=MAX_EVENTS)
        """(wall time, kind, text) of the job's latest events: rounds, failures, state changes,
        scale plans (the dashboard's timeline); in memory only."""
        self._expected: set[str] = set()
        """Replacements launched but not registered yet (`expect`): while there are any,
        losing every node does not fail the job."""
        self._excluded: set[str] = set()
        """Nodes replaced as stragglers: they may not register again."""
        self._activated_round = 0
        # The longest heartbeat interval told recently (see heartbeat_interval_s); a restarted
        # master assumes its nodes were told what their number asks for.
        self._told_high = self.nodes.count(*ALIVE_STATES) / config.heartbeats_per_s
        self._told_high_at = clock()
        rdzv = _restored_rendezvous(store, config.rendezvous)
        if rdzv is not None:
            self._start_rendezvous(rdzv)
        saved = store.get_json(_NAMESPACE, "state") or {}
        self.state = JobState(saved.get("state", JobState.PENDING.value))
        self.reason: str = saved.get("reason", "")
        self.exit_code: int = saved.get("exit_code", 0)
        self.ended = threading.Event()
        if self.state in (JobState.SUCCEEDED, JobState.FAILED):
            self.ended.set()
        if self.rendezvous is not None and self.rendezvous.world is not None:
            self._activated_round = self.rendezvous.world.round
            # A round formed under a master before this one: its workers kept training, and
            # their steps since this master started count (counted from this master).
            self.goodput.on_round(clock(), self._activated_round, resumed=True)

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
        with self._lock:
            if self.rendezvous is None:
                if rdzv is None:
                    raise RendezvousError("the first node must say how many nodes the job has")
                self._start_rendezvous(rdzv)
                logger.info(
                    "job %s: nodes %d:%d (node_unit %d)",
                    self.config.job_name,
                    rdzv.min_nodes,
                    rdzv.max_nodes,
                    rdzv.node_unit,
                )
            elif rdzv is not None:
                have = self.rendezvous.config
                if (rdzv.min_nodes, rdzv.max_nodes) != (have.min_nodes, have.max_nodes):
                    raise RendezvousError(
                        f"this node was started with --nnodes {rdzv.min_nodes}:{rdzv.max_nodes} "
                        f"but the job has {have.min_nodes}:{have.max_nodes}; start every node "
                        "with the same --nnodes"
                    )
            self._expected.discard(node_id)
            if node_id in self._excluded:
                raise NodeError(
                    f"node {node_id} was replaced as a straggler; it may not join again"
                )
            return self.nodes.register(node_id, host, role, local_world_size, requested_rank, pid)

    def _start_rendezvous(self, rdzv: RendezvousConfig) -> None:
        """Fix the job's node range (saved, so a restarted master knows it) and its rounds."""
        self.rendezvous = RendezvousManager(rdzv, self._store, self._clock)
        self._store.put_json(_NAMESPACE, "rendezvous", dataclasses.asdict(rdzv))

    def heartbeat_interval_s(self) -> float:
        """The shortest heartbeat interval the job's size allows: live nodes / the budget (an
        agent beats at the larger of this and its own interval)."""
        interval = self._alive() / self.config.heartbeats_per_s
        now = self._clock()
        with self._lock:
            if interval >= self._told_high:
                self._told_high, self._told_high_at = interval, now
            elif now - self._told_high_at > 2 * self._told_high:
                # Every node told the high mark has beaten since and heard a lower one; halve it,
                # so a node told anything in between is still covered by 3 x the new mark.
                self._told_high, self._told_high_at = max(interval, self._told_high / 2), now
        return interval

    def heartbeat_timeout_s(self) -> float:
        """Silence after which a node is lost: the configured timeout, or 3 times the longest
        interval recently told to a node (a shrinking job must not lose the nodes that were told
        to beat rarely)."""
        with self._lock:
            return max(self.config.heartbeat_timeout_s, 3.0 * self._told_high)

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
    ) -> str:
        """Record liveness (and the node's step time for straggler scores, its workers' step
        for goodput); returns the action for the agent ("", "stop" or "reregister")."""
        state = self.nodes.record_heartbeat(
            node_id, incarnation, step, cpu, mem, restarts, breakdown, persist_s
        )
        world = self.rendezvous.world if self.rendezvous is not None else None
        if sample is not None and world is not None and world.member(node_id) is not None:
            self.goodput.on_progress(self._clock(), world.round, sample)
        if step_time_s > 0:
            with self._lock:
                self.stragglers.observe(node_id, step_time_s)
        if state == NodeState.LOST:
            # A node that was presumed lost is heard again: it must re-register.
            return "reregister"
        return "stop" if self.ended.is_set() else ""

    def report_step(self, node_id: str, step: int) -> None:
        """Record a step a training process of ``node_id`` finished (also a sign of life). Raises
        UnknownNodeError."""
        self.nodes.record_step(node_id, step)

    # --- rendezvous --------------------------------------------------------------------------
    def _rdzv(self) -> RendezvousManager:
        if self.rendezvous is None:
            raise RendezvousError("no node has registered yet")
        return self.rendezvous

    def rendezvous_config(self) -> RendezvousConfig:
        """The job's node range, fixed by the first registration."""
        return self._rdzv().config

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
        NodeError for a stale incarnation, RendezvousError once the job has ended."""
        node = self.nodes.get(node_id, incarnation)
        self.nodes.touch(node_id)
        if self.ended.is_set():
            raise RendezvousError(f"the job has ended ({self.state.value}); nothing to join")
        if node.state in (NodeState.RUNNING, NodeState.LOST):
            self.nodes.set_state(node_id, NodeState.PENDING, "joins a new rendezvous round")
        # Its workers are gone (restart or re-form): what they leased goes back to the queues.
        self.sharding.recover_node(node_id)
        rdzv = self._rdzv()
        round = rdzv.join(
            node_id,
            local_world_size,
            node.host,
            store_host,
            store_port,
            node.requested_rank,
            node.order,
        )
        self.membership.bump()  # running nodes may have to re-form for it
        self.close_round_if_due()
        return round

    def close_round_if_due(self) -> World | None:
        """Close the waiting round if it may close now (max nodes, every live node waits, or the
        last call passed) and wake its nodes; returns the new world, else None."""
        if self.rendezvous is None:
            return None
        world = self.rendezvous.maybe_close(self._alive())
        if world is not None:
            self._activate(world)
        return world

    def close_deadline(self) -> float | None:
        """When the waiting round's last call ends (master clock), or None if none is due."""
        return self.rendezvous.close_deadline() if self.rendezvous is not None else None

    def _alive(self) -> int:
        return self.nodes.count(*ALIVE_STATES)

    def _activate(self, world: World) -> None:
        """Once per closed round: record the members' ranks, make them RUNNING (and the job), and
        wake everyone waiting on the round or watching membership."""
        with self._lock:
            if world.round <= self._activated_round:
                return
            self._activated_round = world.round
            self.goodput.on_round(self._clock(), world.round)
            self.event(
                "round", f"round {world.round}: {len(world.members)} nodes, world size "
                f"{world.world_size}"
            )  # fmt: skip
            for m in world.members:
                self.nodes.set_rank(m.node_id, m.node_rank)
                if self.nodes.get(m.node_id).state == NodeState.PENDING:
                    self.nodes.set_state(
                        m.node_id, NodeState.RUNNING, f"member of round {world.round}"
                    )
            if self.state == JobState.PENDING:
                self._set_job_state(JobState.RUNNING, f"round {world.round} formed")
        self.rounds.bump()
        self.membership.bump()

    def get_world(self, node_id: str, incarnation: int) -> World | None:
        """The node's world once its round has closed, else None. A closed round's pending
        members become RUNNING, and a pending job too; ``incarnation`` 0 skips the incarnation
        check."""
        self.nodes.get(node_id, incarnation)
        self.nodes.touch(node_id)
        world = self._rdzv().get_world(node_id, self._alive())
        if world is not None and world.round > self._activated_round:
            self._activate(world)
        return world

    def lost_join(self, node_id: str, round: int) -> bool:
        """Whether the node's join for ``round`` is unknown here (see RendezvousManager)."""
        return self._rdzv().lost_join(node_id, round)

    def num_nodes_waiting(self, node_id: str, round: int) -> tuple[int, int]:
        """(waiting nodes that should make the running world re-form, the latest round); also a sign
        of life of the node."""
        self.nodes.touch(node_id)
        return self._rdzv().num_nodes_waiting(node_id, round)

    # --- diagnosis ----------------------------------------------------------------------------
    def _on_committed(self, step: int) -> None:
        self._store.put_json("checkpoint", "committed", step)
        self.event("ckpt", f"checkpoint of step {step} committed to storage")

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

    def event(self, kind: str, text: str) -> None:
        """Add ``text`` to the timeline (kinds: round, failure, job, scale, node, ckpt)."""
        self.events.append((time.time(), kind, text))

    def record_failure(self, record: FailureRecord) -> None:
        """Keep a classified failure (in the state: it outlives the master) and log it."""
        self.event(
            "failure",
            f"{record.node_id}: {record.failure_class.value} -> {record.action}: "
            f"{record.root_cause.splitlines()[0][:200] if record.root_cause else ''}",
        )
        with self._lock:
            self._failure_seq += 1
            self._failures.append(record)
            self._store.put_json(
                diagnosis.NAMESPACE, diagnosis.key(self._failure_seq), diagnosis.to_json(record)
            )
            if len(self._failures) > diagnosis.MAX_FAILURES:
                self._failures.pop(0)
                self._store.delete(
                    diagnosis.NAMESPACE, diagnosis.key(self._failure_seq - diagnosis.MAX_FAILURES)
                )
        logger.info(
            "failure of node %s: %s -> %s: %s",
            record.node_id,
            record.failure_class.value,
            record.action,
            record.root_cause.splitlines()[0] if record.root_cause else "",
        )

    def failures(self) -> tuple[FailureRecord, ...]:
        """Every failure kept, oldest first."""
        with self._lock:
            return tuple(self._failures)

    def _record(self, node_id: str, cls: FailureClass, action: str, cause: str) -> None:
        restarts = 0
        try:
            restarts = self.nodes.get(node_id).restart_count
        except NodeError:
            pass
        self.record_failure(FailureRecord(time.time(), node_id, cls, action, cause, restarts))

    # --- the pre-flight node check ----------------------------------------------------------
    def join_node_check(self, join: NodeCheckJoin) -> None:
        """A node is ready for a round of the node check of its rendezvous round (see
        dlrover/master/node_check.py). The check starts with the first join of a closed round's
        member; a join for an older rendezvous round is answered REFORM by `node_check_task`."""
        self.nodes.get(join.node_id, join.incarnation)
        self.nodes.touch(join.node_id)
        with self._lock:
            world = self.rendezvous.world if self.rendezvous else None
            if world is None or world.round != join.rdzv_round:
                return
            if self._check is None or self._check.rdzv_round != world.round:
                members = [m.node_id for m in sorted(world.members, key=lambda m: m.node_rank)]
                self._check = NodeCheck(
                    world.round,
                    members,
                    CheckSettings(join.straggler_ratio, join.exclude_stragglers),
                    self._clock,
                    already_checked=self._checked,
                )
                logger.info(
                    "node check of round %d: %d nodes (%s)",
                    world.round,
                    len(members),
                    "all checked before" if self._check.verdict else "checking",
                )
            before = self._check.version
            self._check.join(join.node_id, join.check_round, join.addr)
            self._after_check_change(before)

    def node_check_task(
        self, node_id: str, rdzv_round: int, check_round: int
    ) -> NodeCheckTask | None:
        """What the node must do for ``check_round``; None while the round waits for members."""
        with self._lock:
            if self.ended.is_set():
                return NodeCheckTask(
                    NodeCheckState.REFORM,
                    check_round,
                    summary=f"the job has ended ({self.state.value})",
                )
            check = self._check
            if check is None or check.rdzv_round != rdzv_round:
                return NodeCheckTask(
                    NodeCheckState.REFORM, check_round, summary="the world changed; join again"
                )
            return check.task(node_id, check_round)

    def report_node_check(self, report: NodeCheckReport) -> None:
        """Record a node's result of a check round."""
        self.nodes.get(report.node_id, report.incarnation)
        self.nodes.touch(report.node_id)
        with self._lock:
            check = self._check
            if check is None or check.rdzv_round != report.rdzv_round:
                return
            if not report.ok:
                logger.warning(
                    "node check round %d: node %s failed: %s",
                    report.check_round,
                    report.node_id,
                    report.error,
                )
            before = check.version
            check.report(
                report.node_id,
                report.check_round,
                CheckResult(report.ok, report.compute_s, report.comm_s, report.error),
            )
            self._after_check_change(before)

    def node_check_deadline(self) -> float | None:
        """When the running check round times out (master clock), or None."""
        with self._lock:
            check = self._check
            return check.deadline() if check is not None else None

    def _after_check_change(self, version: int = -1) -> None:
        """Wake the check's waiters if the check moved on (past ``version``); once the verdict
        is out, act on it (once)."""
        check = self._check
        assert check is not None
        if check.version == version:
            return  # a join or report that changed nothing anyone waits for
        verdict = check.verdict
        if verdict is not None and not check.applied:
            check.applied = True
            if verdict.rounds:
                logger.info("%s", verdict.summary)
                self.check_summary = verdict.summary
            for node in check.members:
                if node in verdict.faulty:
                    self.check_words[node] = "faulty"
                elif node in verdict.stragglers:
                    self.check_words[node] = f"straggler {verdict.stragglers[node]:.1f}x"
                elif node in verdict.times:
                    self.check_words[node] = f"ok {verdict.times[node]:.2f}s"
                if node not in verdict.excluded:
                    self._checked.add(node)
            for node in verdict.excluded:
                faulty = node in verdict.faulty
                self._record(
                    node,
                    FailureClass.CHECK_FAILED if faulty else FailureClass.STRAGGLER,
                    "exclude",
                    verdict.faulty[node]
                    if faulty
                    else f"node check: {verdict.stragglers[node]:.1f}x the median check time",
                )
                self.node_lost(node, f"excluded by the node check: {verdict.summary}")
        self.checks.bump()

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
            elif status == "failed":
                self.nodes.set_state(node_id, NodeState.FAILED, reason or "workers failed")
                self.nodes.set_exit_code(node_id, exit_code)
                self._fail(f"node {node_id} failed: {reason}", exit_code or 1)
            else:
                raise RendezvousError(f"unknown node status {status!r}: use succeeded or failed")
            return self.state == JobState.SUCCEEDED

    def _check_success(self) -> None:
        world = self.rendezvous.world if self.rendezvous else None
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
        self._save()
        self.goodput.on_end(self._clock())
        self.ended.set()
        self.rounds.bump()
        self.membership.bump()

    def _fail(self, reason: str, exit_code: int) -> None:
        if self.ended.is_set():
            return
        self.exit_code = exit_code
        self._set_job_state(JobState.FAILED, reason)
        self._save()
        self.goodput.on_end(self._clock())
        self.ended.set()
        self.rounds.bump()
        self.membership.bump()
        self.checks.bump()  # a node check in progress ends with the job

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

    def node_lost(self, node_id: str, reason: str) -> None:
        """An engine says the node's process is gone: drop it now, not at the heartbeat timeout."""
        try:
            node = self.nodes.get(node_id)
        except NodeError:
            return  # it died before it registered: nothing of it is in the job
        if node.state in ALIVE_STATES:
            self.nodes.set_state(node_id, NodeState.LOST, reason)
            self.event("node", f"{node_id} lost: {reason}")
        self._check_lost(node_id, reason)
        with self._lock:
            self.stragglers.forget(node_id)
            self._expected.discard(node_id)
        if self.rendezvous is not None:
            self.rendezvous.leave(node_id, reason)
        self.sharding.recover_node(node_id)
        self.membership.bump()

    def _score_stragglers(self) -> None:
        """A straggler report: score the running members of the current round; act on nodes
        that stayed below the threshold for the set number of reports."""
        world = self.rendezvous.world if self.rendezvous else None
        if world is None or self.ended.is_set():
            return
        members = [
            m.node_id for m in world.members if self.nodes.get(m.node_id).state == NodeState.RUNNING
        ]
        scores, new = self.stragglers.report(members)
        if len(scores) < 2:
            return
        logger.info("straggler scores: %s", ", ".join(s.describe() for s in scores))
        watch = self.stragglers
        for node in new:
            score = watch.scores[node]
            action = (
                "replacing it"
                if self.config.exclude_stragglers
                else "kept (no --exclude-straggler)"
            )
            logger.warning(
                "runtime straggler: node %s scored below %.2f of the fastest node in %d reports in "
                "a row (now %.2f, %.3fs/step); %s",
                node,
                watch.threshold,
                watch.reports,
                score.relative,
                score.step_time_s,
                action,
            )
            cause = (
                f"runtime score {score.relative:.2f} of the fastest node in {watch.reports} "
                f"reports in a row ({score.step_time_s:.3f}s/step)"
            )
            if self.config.exclude_stragglers:
                self._excluded.add(node)
                self._replace.append((node, cause))  # the controller records what it did
            else:
                self._record(node, FailureClass.STRAGGLER, "none", cause)

    def straggler_scores(self) -> dict[str, Score]:
        """A copy of the latest straggler report's scores by node (the tick and departures
        change them under the job's lock)."""
        with self._lock:
            return dict(self.stragglers.scores)

    def take_replacements(self) -> list[tuple[str, str]]:
        """(node, why) to replace as stragglers since the last call: the node controller
        deletes each and launches its slot's next attempt, or keeps it (`keep_straggler`)."""
        with self._lock:
            taken, self._replace = self._replace, []
            return taken

    def keep_straggler(self, node_id: str, cause: str) -> None:
        """The controller could not replace ``node_id``: it stays (and may register again)."""
        with self._lock:
            self._excluded.discard(node_id)
        self._record(node_id, FailureClass.STRAGGLER, "none", f"{cause}; kept: no relaunch left")

    def expect(self, node_id: str) -> None:
        """A node controller launched ``node_id`` to replace a lost node: until it registers,
        or is lost itself, the job does not fail for having no live node."""
        with self._lock:
            self._expected.add(node_id)

    def unexpect(self, node_id: str) -> None:
        """The replacement `expect` announced will not be launched after all."""
        with self._lock:
            self._expected.discard(node_id)

    def _check_lost(self, node_id: str, reason: str) -> None:
        with self._lock:
            check = self._check
            if check is not None and check.verdict is None and node_id in check.members:
                check.abort(f"node {node_id} left ({reason})")
                self.checks.bump()

    def tick(self) -> None:
        """Time-based work: lose nodes whose heartbeats stopped, close a round whose last call
        passed; then run the tick hooks."""
        timeout = self.heartbeat_timeout_s()
        expired = self.nodes.expired(timeout)
        for node in expired:
            self.nodes.set_state(node.node_id, NodeState.LOST, f"no heartbeat for {timeout:.1f}s")
            self._record(
                node.node_id, FailureClass.NODE_LOST, "drop", f"no heartbeat for {timeout:.1f}s"
            )
            self._check_lost(node.node_id, "lost")
            if self.rendezvous is not None:
                self.rendezvous.leave(node.node_id, "lost")
            self.sharding.recover_node(node.node_id)
        if expired:
            self.membership.bump()
        self.sharding.tick()
        self.goodput.sample(self._clock(), time.time())
        with self._lock:
            if self._check is not None and self._check.tick():
                self._after_check_change()
            if self.stragglers.due():
                self._score_stragglers()
        self.close_round_if_due()
        with self._lock:
            if (
                not self.ended.is_set()
                and not self._expected  # no replacement is on its way
                and self._alive() == 0
                and self.nodes.count(NodeState.LOST) > 0
            ):
                self._fail("every node was lost", 1)
            elif not self.ended.is_set() and self.state == JobState.RUNNING:
                self._check_success()
        # Last, each on its own: an exporter's failure (a full disk) must not skip the job's work.
        for hook in list(self.tick_hooks):
            try:
                hook(self._clock())
            except Exception:
                logger.exception("tick hook %r failed", hook)

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
