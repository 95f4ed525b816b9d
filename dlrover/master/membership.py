"""The master's membership part: the node table, rendezvous rounds, heartbeats and one `lose`."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

from dlrover.api.master import (
    CommWorld,
    HeartbeatAction,
    HeartbeatReply,
    HeartbeatReport,
    JoinRequest,
    NodeLimits,
    Registered,
    Registration,
    Waiting,
)
from dlrover.constants import SPREAD_NODES_PER_S
from dlrover.master.changes import ChangeFeed, LongPoll
from dlrover.master.nodes import ALIVE_STATES, NodeError, NodeState, NodeTable
from dlrover.master.rendezvous import RendezvousConfig, RendezvousError, RendezvousManager, World
from dlrover.master.state_store import StateStore

# The job's parts log as the job: their lines were always the job's log, and people (and
# tests/e2e/test_node_check.py) read them as "dlrover.master.job: ...".
logger = logging.getLogger("dlrover.master.job")

NAMESPACE = "job"
"""The state namespace of the job's node range (shared with the job's own state)."""

RoundListener = Callable[[World], None]
"""Told once per closed round, under the job's lock, after its members became RUNNING."""
LossListener = Callable[[str, str, bool, bool], None]
"""Told (node id, cause, whether it was alive, whether it went silent) by `lose`."""
HeartbeatListener = Callable[[HeartbeatReport, "World | None"], None]
"""Told each heartbeat and the latest closed round's world (goodput, step times)."""


def restored_rendezvous(
    store: StateStore, given: RendezvousConfig | None
) -> RendezvousConfig | None:
    """The node range of this job: the one a previous master of it saved, else ``given``.

    Raises RendezvousError when both exist and differ (a restarted master must keep the job's
    --nnodes, or start on a new state file).
    """
    saved = store.get_json(NAMESPACE, "rendezvous")
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


class Membership:
    """Who is in the job: registration, liveness, rendezvous rounds, and losing a node. It serves
    `MembershipApi` (the long polls as `comm_world_poll` and `membership_poll`).

    Every departure goes through `lose` (an engine's event, a heartbeat timeout, the node check,
    a scale-in or a resize), so each forgets the same things: the node leaves the round, is no
    longer an expected replacement, and every `LossListener` (the failure log, the straggler
    scores, the node check, the shard queues) hears of it. Long polls wait on two change feeds:
    `rounds` (a round closed, the job ended) and `changes` (also joins and departures). It knows
    nothing of the parts that listen to it; they subscribe (`on_round`, `on_lost`, `on_rejoin`).
    """

    def __init__(
        self,
        store: StateStore,
        clock: Callable[[], float],
        lock: threading.RLock,
        ended: threading.Event,
        heartbeat_timeout_s: float,
        heartbeats_per_s: float,
        rendezvous: RendezvousConfig | None,
        job_name: str = "none",
        job_state: Callable[[], str] = lambda: "pending",
    ) -> None:
        self._store = store
        self._job_name = job_name
        self._job_state = job_state
        """The job's state (a `JobState` value): the heartbeat's answer, and how it ended (said
        to a node that joins after)."""
        self._clock = clock
        self._lock = lock
        self._ended = ended
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._heartbeats_per_s = heartbeats_per_s
        self.nodes = NodeTable(store, clock)
        self.rendezvous: RendezvousManager | None = None
        self.rounds = ChangeFeed()
        self.changes = ChangeFeed()
        self.on_round: list[RoundListener] = []
        self.on_lost: list[LossListener] = []
        self.on_rejoin: list[Callable[[str], object]] = []
        """Told the node id when a node joins a new round: its workers are gone."""
        self.on_joined: list[Callable[[], object]] = []
        """Told after every join (the job fails a round that can never form)."""
        self.on_heartbeat: list[HeartbeatListener] = []
        """Told every heartbeat of a known incarnation, with the latest world."""
        self._expected: set[str] = set()
        """Replacements launched but not registered yet (`expect`): while there are any,
        losing every node does not fail the job."""
        self._excluded: set[str] = set()
        """Nodes replaced as stragglers: they may not register again."""
        self.activated_round = 0
        # The longest heartbeat interval told recently (see heartbeat_interval_s); a restarted
        # master assumes its nodes were told what their number asks for.
        self._told_high = self.nodes.count(*ALIVE_STATES) / heartbeats_per_s
        self._told_high_at = clock()
        config = restored_rendezvous(store, rendezvous)
        if config is not None:
            self.start_rendezvous(config)
        if self.rendezvous is not None and self.rendezvous.world is not None:
            self.activated_round = self.rendezvous.world.round

    # --- registration and liveness -----------------------------------------------------------
    def register_node(self, registration: Registration) -> Registered:
        """Admit an agent (`MembershipApi.register_node`): a new node, or a known id again with a
        bumped incarnation. The first registration must carry limits, which fix the node range;
        a later one with other min/max nodes raises RendezvousError; a node replaced as a
        straggler raises NodeError; a ``local_world_size`` below 1 raises ValueError."""
        r = registration
        if r.local_world_size < 1:
            raise ValueError(f"local_world_size must be >= 1, got {r.local_world_size}")
        with self._lock:
            if self.rendezvous is None:
                if r.limits is None:
                    raise RendezvousError("the first node must say how many nodes the job has")
                self.start_rendezvous(RendezvousConfig.of(r.limits))
                logger.info(
                    "job %s: nodes %d:%d (node_unit %d)",
                    self._job_name,
                    r.limits.min_nodes,
                    r.limits.max_nodes,
                    max(1, r.limits.node_unit),
                )
            elif r.limits is not None:
                have = self.rendezvous.config
                if (r.limits.min_nodes, r.limits.max_nodes) != (have.min_nodes, have.max_nodes):
                    raise RendezvousError(
                        f"this node was started with --nnodes {r.limits.min_nodes}:"
                        f"{r.limits.max_nodes} but the job has {have.min_nodes}:"
                        f"{have.max_nodes}; start every node with the same --nnodes"
                    )
            self._expected.discard(r.node_id)
            if r.node_id in self._excluded:
                raise NodeError(
                    f"node {r.node_id} was replaced as a straggler; it may not join again"
                )
            node = self.nodes.register(
                r.node_id, r.host, r.role, r.local_world_size, r.requested_rank, r.pid
            )
            have = self.rdzv().config
        return Registered(
            node_id=node.node_id,
            incarnation=node.incarnation,
            limits=NodeLimits(
                have.min_nodes, have.max_nodes, have.node_unit, have.last_call_timeout_s
            ),
            job_name=self._job_name,
            heartbeat_interval_s=self.heartbeat_interval_s(),
        )

    def start_rendezvous(self, rdzv: RendezvousConfig) -> None:
        """Fix the job's node range (saved, so a restarted master knows it) and its rounds."""
        self.rendezvous = RendezvousManager(rdzv, self._store, self._clock)
        self._store.put_json(NAMESPACE, "rendezvous", dataclasses.asdict(rdzv))

    def alive(self) -> int:
        """Nodes in a live state (pending or running)."""
        return self.nodes.count(*ALIVE_STATES)

    def heartbeat_interval_s(self) -> float:
        """The shortest heartbeat interval the job's size allows: live nodes / the budget."""
        interval = self.alive() / self._heartbeats_per_s
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
        interval recently told to a node."""
        with self._lock:
            return max(self._heartbeat_timeout_s, 3.0 * self._told_high)

    def heartbeat(self, report: HeartbeatReport) -> HeartbeatReply:
        """Record this incarnation's liveness, usage and progress (`MembershipApi.heartbeat`) and
        tell the heartbeat listeners; answer REREGISTER to a node taken for lost, STOP once the
        job ended."""
        state = self.nodes.record_heartbeat(report)
        world = self.world()
        for listener in self.on_heartbeat:
            listener(report, world)
        if state == NodeState.LOST:
            action = HeartbeatAction.REREGISTER  # heard again after it was presumed lost
        elif self._ended.is_set():
            action = HeartbeatAction.STOP
        else:
            action = HeartbeatAction.NONE
        return HeartbeatReply(action, self._job_state(), self.heartbeat_interval_s())

    def report_step(
        self,
        step: int,
        rank: int | None = None,
        metrics: dict[str, float] | None = None,
        node_id: str | None = None,
    ) -> None:
        """Record a step a training process of ``node_id`` finished (also a sign of life);
        ``rank`` and ``metrics`` are not kept. Raises UnknownNodeError (no ``node_id`` too)."""
        self.nodes.record_step(node_id or "", step)

    # --- replacements on their way, stragglers shut out -----------------------------------------
    def expect(self, node_id: str) -> None:
        """A replacement ``node_id`` was launched: until it registers or is lost, losing every
        node does not fail the job."""
        with self._lock:
            self._expected.add(node_id)

    def unexpect(self, node_id: str) -> None:
        """The replacement `expect` announced will not be launched after all."""
        with self._lock:
            self._expected.discard(node_id)

    def expecting(self) -> bool:
        """Whether a replacement is on its way."""
        with self._lock:
            return bool(self._expected)

    def unformable(self) -> str:
        """Why the waiting rendezvous round can never close, or "" while it may: after nodes
        succeeded (their workers exited 0; their agents only wait for the job's end and never
        join again), a node that restarted its workers waits for a round that fewer than min
        nodes can join (the alive ones and replacements on their way)."""
        rdzv = self.rendezvous
        # The counts first (O(1)): this runs on every join of a large first rendezvous.
        if rdzv is None or self.nodes.count(NodeState.SUCCEEDED) == 0 or self.expecting():
            return ""
        waiting = rdzv.waiting()
        if not waiting:
            return ""
        nodes = self.nodes.all()
        succeeded = sorted(n.node_id for n in nodes if n.state == NodeState.SUCCEEDED)
        could_join = sum(n.state in ALIVE_STATES for n in nodes)
        if not succeeded or could_join >= rdzv.config.min_nodes:
            return ""
        return (
            f"rendezvous round {rdzv.round + 1} can never form: {', '.join(waiting)} restarted "
            f"its workers after {', '.join(succeeded)} succeeded (their workers exited 0 and do "
            f"not join again), and it needs {rdzv.config.min_nodes} nodes of which {could_join} "
            f"can join; the restart's cause is in `dlrover diagnose`"
        )

    def exclude(self, node_id: str) -> None:
        """``node_id`` may not register again (replaced as a straggler)."""
        with self._lock:
            self._excluded.add(node_id)

    def readmit(self, node_id: str) -> None:
        """``node_id`` was not replaced after all: it may register again."""
        with self._lock:
            self._excluded.discard(node_id)

    # --- rendezvous --------------------------------------------------------------------------
    def rdzv(self) -> RendezvousManager:
        """The rendezvous; RendezvousError before the first registration."""
        if self.rendezvous is None:
            raise RendezvousError("no node has registered yet")
        return self.rendezvous

    def world(self) -> World | None:
        """The latest closed round's world, if any."""
        return self.rendezvous.world if self.rendezvous is not None else None

    def join_rendezvous(self, request: JoinRequest) -> int:
        """Put the node into the next round and return its number (`MembershipApi`); a running or
        lost node goes back to PENDING and `on_rejoin` is told, then `on_joined`. Raises
        NodeError for a stale incarnation, RendezvousError once the job has ended."""
        node = self.nodes.get(request.node_id, request.incarnation)
        self.nodes.touch(request.node_id)
        if self._ended.is_set():
            raise RendezvousError(f"the job has ended ({self._job_state()}); nothing to join")
        if node.state in (NodeState.RUNNING, NodeState.LOST):
            self.nodes.set_state(request.node_id, NodeState.PENDING, "joins a new rendezvous round")
        # Its workers are gone (restart or re-form): what they leased goes back to the queues.
        for listener in self.on_rejoin:
            listener(request.node_id)
        round = self.rdzv().join(
            request.node_id,
            request.local_world_size,
            node.host,
            request.store_host,
            request.store_port,
            node.requested_rank,
            node.order,
        )
        self.changes.bump()  # running nodes may have to re-form for it
        self.close_round_if_due()
        for joined in self.on_joined:
            joined()
        return round

    def comm_world_poll(self, node_id: str, round: int) -> LongPoll[CommWorld]:
        """`get_comm_world` as a long poll: it ends when the round closes, when the node must
        join again, or when the job ended."""

        def check() -> CommWorld | None:
            world = self.comm_world_now(node_id, round)
            if world.complete or world.rejoin or self._ended.is_set():
                return world
            return None

        return LongPoll(
            self.rounds, check, lambda: self.comm_world_now(node_id, round), self.close_deadline
        )

    def comm_world_now(self, node_id: str, round: int) -> CommWorld:
        """The node's world once its round closed, with this node's rank and global rank offset.
        Incomplete, ``rejoin`` is set when the master does not know the node to wait for
        ``round`` (the round its join returned): it restarted since. No incarnation is
        checked."""
        world = self.get_world(node_id, 0)
        if world is None:
            rdzv = self.rdzv()
            rejoin = round > 0 and rdzv.lost_join(node_id, round)
            return CommWorld(
                round=round, complete=False, rejoin=rejoin, spare=rdzv.is_spare(node_id)
            )
        me = world.member(node_id)
        assert me is not None
        return CommWorld(
            round=world.round,
            complete=True,
            num_nodes=len(world.members),
            node_rank=me.node_rank,
            world_size=world.world_size,
            rank_offset=world.rank_offset(me.node_rank),
            store_host=world.store_host,
            store_port=world.store_port,
            spread_s=self.spread_s(),
        )

    def spread_s(self) -> float:
        """Over how many seconds the nodes spread the calls one change makes them all send
        (see SPREAD_NODES_PER_S)."""
        return self.alive() / SPREAD_NODES_PER_S

    def close_deadline(self) -> float | None:
        """When the waiting round's last call ends (master clock), or None if none is due."""
        return self.rendezvous.close_deadline() if self.rendezvous is not None else None

    def membership_poll(self, node_id: str, round: int) -> LongPoll[Waiting]:
        """`num_nodes_waiting` as the membership watch of a running node: it ends as soon as its
        world must re-form or the job ended."""

        def check() -> Waiting | None:
            w = self.waiting_now(node_id, round)
            return w if w.waiting > 0 or w.latest_round > round or w.job_ended else None

        return LongPoll(self.changes, check, lambda: self.waiting_now(node_id, round))

    def waiting_now(self, node_id: str, round: int) -> Waiting:
        """Waiting nodes that should make the running world re-form now, the newest round, and
        whether the job ended; also a sign of life of the node."""
        self.nodes.touch(node_id)
        waiting, latest = self.rdzv().num_nodes_waiting(node_id, round)
        reform = waiting > 0 or latest > round
        return Waiting(waiting, latest, self._ended.is_set(), self.spread_s() if reform else 0.0)

    def close_round_if_due(self) -> World | None:
        """Close the waiting round if it may close now (max nodes, every live node waits, or the
        last call passed) and wake its nodes; returns the new world, else None."""
        if self.rendezvous is None:
            return None
        world = self.rendezvous.maybe_close(self.alive())
        if world is not None:
            self._activate(world)
        return world

    def _activate(self, world: World) -> None:
        """Once per closed round: record the members' ranks, make them RUNNING, tell the round
        listeners, and wake everyone waiting on the round or watching membership."""
        with self._lock:
            if world.round <= self.activated_round:
                return
            self.activated_round = world.round
            self.nodes.activate(
                {m.node_id: m.node_rank for m in world.members}, f"member of round {world.round}"
            )
            for listener in self.on_round:
                listener(world)
        self.rounds.bump()
        self.changes.bump()

    def get_world(self, node_id: str, incarnation: int) -> World | None:
        """The node's world once its round has closed, else None (a closed round is activated
        here if no one did yet); ``incarnation`` 0 skips the incarnation check."""
        self.nodes.get(node_id, incarnation)
        self.nodes.touch(node_id)
        world = self.rdzv().get_world(node_id, self.alive())
        if world is not None and world.round > self.activated_round:
            self._activate(world)
        return world

    # --- departures --------------------------------------------------------------------------
    def lose(self, node_id: str, cause: str, silent: bool = False) -> None:
        """The one way a node leaves the job: it becomes LOST (if it was alive), is no longer
        expected, leaves its round, and every `on_lost` listener is told; ``silent``: its
        heartbeats stopped (the failure log records that). A node that never registered is
        ignored."""
        self._lose(node_id, cause, silent)
        self.changes.bump()

    def lose_silent(self, timeout_s: float) -> list[str]:
        """Lose every node whose heartbeats stopped ``timeout_s`` ago; waking the watchers once
        for all of them. Returns their ids."""
        lost = [node.node_id for node in self.nodes.expired(timeout_s)]
        for node_id in lost:
            self._lose(node_id, f"no heartbeat for {timeout_s:.1f}s", silent=True)
        if lost:
            self.changes.bump()
        return lost

    def _lose(self, node_id: str, cause: str, silent: bool) -> None:
        try:
            node = self.nodes.get(node_id)
        except NodeError:
            return  # it died before it registered: nothing of it is in the job
        alive = node.state in ALIVE_STATES
        if alive:
            self.nodes.set_state(node_id, NodeState.LOST, cause)
        with self._lock:
            self._expected.discard(node_id)
        if self.rendezvous is not None:
            self.rendezvous.leave(node_id, "lost" if silent else cause)
        for listener in self.on_lost:
            listener(node_id, cause, alive, silent)
