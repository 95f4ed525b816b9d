"""The job master: an assembler of its parts, each serving its own calls.

Each part is its own module and imports none of the others nor this one (a part that reads
others, the status view and the lifecycle, takes them in its constructor); the job builds them
and wires their listeners, and the RPC layer binds each interface of `dlrover.api.master` to the
part that serves it (`services`):

- `Membership` (membership.py): node table, heartbeats, rendezvous rounds, the one `lose`;
- `JobLifecycle` (lifecycle.py): the job's state and its end (the exit barrier, a stop);
- `JobStatusView` (status.py): the job's status as tools read it;
- `Diagnostics` (diagnostics.py): failure log, runtime stragglers, goodput, timeline;
- `Preflight` (preflight.py): the node check of each round;
- `RoleRegistry` (roles.py): each role's controller, which relaunches through the one
  `RelaunchPolicy` (relaunch_policy.py);
- the key-value store, dynamic sharding and checkpoint commit votes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from dlrover.api import master as api
from dlrover.api.sharding import ShardingTransport, StreamTransport
from dlrover.checkpoint.coordinator import CommitVotes
from dlrover.collectives import laggards, merge
from dlrover.constants import DEFAULT_HEARTBEAT_TIMEOUT_S, HEARTBEATS_PER_S_BUDGET
from dlrover.decisions import NO_ACTION, FailureAction
from dlrover.master.compile_cache import CompileCacheStore
from dlrover.master.diagnostics import MAX_EVENTS, Diagnostics
from dlrover.master.kv_store import KvStore
from dlrover.master.lifecycle import JobLifecycle, JobState
from dlrover.master.membership import Membership
from dlrover.master.nodes import NodeState
from dlrover.master.preflight import Preflight
from dlrover.master.rendezvous import RendezvousConfig, RendezvousManager, World
from dlrover.master.roles import RoleRegistry
from dlrover.master.sharding_service import ShardingService
from dlrover.master.state_store import StateStore
from dlrover.master.status import JobStatusView
from dlrover.master.stragglers import DEFAULT_REPORT_S

__all__ = ["MAX_EVENTS", "JobMaster", "JobMasterConfig", "JobState"]

logger = logging.getLogger(__name__)


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
    """The single source of truth of one job: its parts, built and wired here. Thread-safe (one
    lock, shared by its parts); `tick()` advances time-based work.

    Long polls wait on three change feeds: `members.rounds` (a round closed, the job ended) for
    nodes waiting to join, `members.changes` (also joins and departures) for running nodes
    watching whether their world must re-form, and `preflight.checks` for the node check. A join
    does not wake the nodes waiting for the round, so forming a round of N nodes costs O(N)
    wake-ups, not O(N^2).
    """

    def __init__(
        self,
        config: JobMasterConfig,
        store: StateStore,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        """The master's clock (monotonic seconds; injectable for tests)."""
        lock = threading.RLock()
        ended = threading.Event()
        self.members = Membership(
            store,
            clock,
            lock,
            ended,
            config.heartbeat_timeout_s,
            config.heartbeats_per_s,
            config.rendezvous,
            job_name=config.job_name,
            job_state=lambda: self.lifecycle.state.value,
        )
        self.diagnostics = Diagnostics(
            store, clock, lock, config.straggler_report_s, self.members.nodes
        )
        self.lifecycle = JobLifecycle(
            config.job_name,
            store,
            lock,
            ended,
            self.members,
            self.diagnostics.event,
            lambda: self.status.get_job_status(),
            self._round_cause,
        )
        self.preflight = Preflight(
            clock,
            lock,
            self.members.nodes,
            self.members.world,
            self.lifecycle.ended_as,
            self._exclude_checked,
            self._keep_checked,
        )
        self.roles = RoleRegistry(config.job_name)
        """Each role's controller (`scale_role` asks it; the node controller routes events)."""
        self.kv = KvStore(store)
        self.compile_cache = CompileCacheStore()
        self.sharding = ShardingService(store, clock)
        self.checkpoint = CommitVotes(
            committed=int(store.get_json("checkpoint", "committed") or -1),
            on_committed=lambda step: self._on_committed(store, step),
        )
        self.status = JobStatusView(
            config.job_name,
            clock,
            self.lifecycle,
            self.members,
            self.preflight,
            self.diagnostics,
            self.roles,
            self.sharding.losses,
        )
        self._lock = lock
        self._tick_hooks: list[Callable[[float], None]] = []
        self.members.on_round.append(self._on_round)
        self.members.on_lost.append(self._on_lost)
        self.members.on_rejoin.append(self.sharding.recover_node)
        self.members.on_joined.append(self.lifecycle.fail_if_unformable)
        self.members.on_heartbeat.append(self.diagnostics.observe_heartbeat)
        self.lifecycle.on_end.append(lambda: self.diagnostics.goodput.on_end(clock()))
        self.lifecycle.on_failed.append(self.preflight.checks.bump)  # a node check ends with it
        self.diagnostics.on_recorded.append(self.lifecycle.recheck_held)
        self.diagnostics.on_recorded.append(self._fail_on_repeated_cause)
        self.diagnostics.on_recorded.append(self._explain_hang)
        self._hang_said: set[str] = set()
        if self.members.activated_round:
            # A round formed under a master before this one: its workers kept training, and
            # their steps since this master started count (counted from this master).
            self.diagnostics.goodput.on_round(clock(), self.members.activated_round, resumed=True)

    def services(self) -> dict[type, object]:
        """Which part serves each interface of the master's RPCs (the gRPC servicer and
        `LocalMasterApi` run every call on it)."""
        return {
            api.MembershipApi: self.members,
            api.LifecycleApi: self.lifecycle,
            api.StatusApi: self.status,
            api.RolesApi: self.roles,
            api.NodeCheckApi: self.preflight,
            api.DiagnosticsApi: self.diagnostics,
            api.KvApi: self.kv,
            api.CheckpointApi: self.checkpoint,
            api.CompileCacheApi: self.compile_cache,
            ShardingTransport: self.sharding,
            StreamTransport: self.sharding,
        }

    @property
    def rendezvous(self) -> RendezvousManager | None:
        """The job's rendezvous (None until the first registration fixes the node range)."""
        return self.members.rendezvous

    # --- wiring of the parts -------------------------------------------------------------------
    def _on_round(self, world: World) -> None:
        """A round closed (under the lock): the failures it follows, goodput, the timeline, and
        the job is RUNNING."""
        self.diagnostics.link_round(world.round)
        self.diagnostics.goodput.on_round(self.clock(), world.round)
        self.diagnostics.event(
            "round", f"round {world.round}: {len(world.members)} nodes, world size "
            f"{world.world_size}"
        )  # fmt: skip
        self.lifecycle.on_round(world)

    def _on_lost(self, node_id: str, cause: str, alive: bool, silent: bool) -> None:
        """A node left (`Membership.lose`): what every other part forgets or records of it."""
        if silent:
            self.diagnostics.record(node_id, api.FailureClass.NODE_LOST, "drop", cause)
        elif alive:
            self.diagnostics.event("node", f"{node_id} lost: {cause}")
        self.preflight.node_left(node_id, "lost" if silent else cause)
        self.diagnostics.forget(node_id)
        self.sharding.recover_node(node_id)

    def _exclude_checked(
        self, node_id: str, cls: api.FailureClass, cause: str, summary: str
    ) -> None:
        """The node check excluded ``node_id``: recorded, and the node is lost."""
        self.diagnostics.record(node_id, cls, "exclude", cause)
        self.members.lose(node_id, f"excluded by the node check: {summary}")

    def _keep_checked(self, node_id: str, cause: str) -> None:
        """The node check named ``node_id`` a straggler and keeps it: recorded all the same."""
        self.diagnostics.record(
            node_id,
            api.FailureClass.STRAGGLER,
            NO_ACTION,
            f"{cause}; kept (no --exclude-straggler)",
        )

    def _round_cause(self, node_id: str) -> tuple[bool, str]:
        """`JobLifecycle`'s view of `Diagnostics.round_cause`: the root cause in one line."""
        collateral, root = self.diagnostics.round_cause(node_id)
        if root is None:
            return collateral, ""
        first = root.root_cause.splitlines()[0] if root.root_cause else root.failure_class.value
        return collateral, f"node {root.node_id}: {first}"

    def _fail_on_repeated_cause(self, record: api.FailureRecord) -> None:
        """The same user error as the previous failed round's root cause, from any node: the job
        fails fast naming it (a node's agent does so for its own errors; this catches one
        raised on another node, or hidden behind other nodes' collateral errors)."""
        if record.action == FailureAction.FAIL.value:
            return  # its agent failed the node: the job fails on its report
        before = self.diagnostics.repeated_cause(record)
        if before is None:
            return
        first = record.root_cause.splitlines()[0] if record.root_cause else record.signature
        where = "" if before.node_id == record.node_id else f" (before on node {before.node_id})"
        self.lifecycle.stop(
            f"same root cause twice in a row ({record.signature}): failing fast; "
            f"node {record.node_id}: {first}{where}"
        )

    def _explain_hang(self, record: api.FailureRecord) -> None:
        """A node's hang report: which rank the others wait for, from every hang report of the
        round so far (each node reports its own ranks, and a node whose ranks wait for another
        node's says what they wait in), on the timeline and in the log."""
        if record.failure_class is not api.FailureClass.HANG or not record.collectives:
            return
        if record.action == NO_ACTION:
            return  # a node that waits says what in; a node's hang verdict uses it
        documents = [r.collectives for r in self.diagnostics.current_failures()]
        for line in laggards(merge(documents)):
            if line not in self._hang_said:
                self._hang_said.add(line)
                self.diagnostics.event("hang", line)
                logger.error("hang: %s", line)

    def _on_committed(self, store: StateStore, step: int) -> None:
        store.put_json("checkpoint", "committed", step)
        self.diagnostics.event("ckpt", f"checkpoint of step {step} committed to storage")

    def keep_straggler(self, node_id: str, cause: str) -> None:
        """The node controller could not replace the straggler ``node_id``: it stays (and may
        register again), recorded."""
        self.members.readmit(node_id)
        self.diagnostics.record(
            node_id, api.FailureClass.STRAGGLER, NO_ACTION, f"{cause}; kept: no relaunch left"
        )

    # --- time ----------------------------------------------------------------------------------
    def tick(self) -> None:
        """Time-based work: lose nodes whose heartbeats stopped, close a round whose last call
        passed, end a job that is over; then run the tick hooks."""
        self.members.lose_silent(self.members.heartbeat_timeout_s())
        self.sharding.tick()
        self.diagnostics.goodput.sample(self.clock(), time.time())
        self.diagnostics.flush()
        self.preflight.tick()
        with self._lock:
            if self.diagnostics.stragglers.due():
                self._score_stragglers()
        self.members.close_round_if_due()
        self.lifecycle.check_end()
        # Last, each on its own: an exporter's failure (a full disk) must not skip the job's work.
        for hook in list(self._tick_hooks):
            try:
                hook(self.clock())
            except Exception:
                logger.exception("tick hook %r failed", hook)

    def add_tick_hook(self, hook: Callable[[float], None]) -> None:
        """Call ``hook`` with the master's time at the end of every `tick` (the TensorBoard
        exporter); one that raises is logged and does not stop the tick or the other hooks."""
        self._tick_hooks.append(hook)

    def _score_stragglers(self) -> None:
        """A straggler report over the running members of the current round; a node queued for
        replacement may not register again."""
        world = self.members.world()
        if world is None or self.lifecycle.ended.is_set():
            return
        nodes = self.members.nodes
        states = {m.node_id: nodes.get(m.node_id).state for m in world.members}
        if NodeState.SUCCEEDED in states.values():
            # The round is finishing: a node replaced now could never rejoin it (the succeeded
            # ones do not), so the replacement would strand the job instead of speeding it up.
            return
        running = [node for node, state in states.items() if state == NodeState.RUNNING]
        for node in self.diagnostics.score_stragglers(running, self.config.exclude_stragglers):
            self.members.exclude(node)
