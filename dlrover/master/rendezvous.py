"""The master's rendezvous: decides which nodes form the world of each round, and their ranks."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from dlrover.api.master import NodeLimits
from dlrover.master.state_store import StateStore

logger = logging.getLogger(__name__)

_NAMESPACE = "rendezvous"
_LOGGED_MEMBERS = 16
"""A closed round's log line names this many members (a 10,000-node list helps nobody)."""


class RendezvousError(Exception):
    """A rendezvous request that cannot be honoured (e.g. an impossible configuration)."""


@dataclass(frozen=True)
class RendezvousConfig:
    """How the world is formed."""

    min_nodes: int
    max_nodes: int
    node_unit: int = 1
    """The world size in nodes is always a multiple of this (e.g. pipeline stages)."""
    last_call_timeout_s: float = 1.0
    """After min nodes are present, wait this long for more before closing the round."""

    @classmethod
    def of(cls, limits: NodeLimits) -> RendezvousConfig:
        """The range agents launch with (a node unit below 1 is 1)."""
        return cls(
            limits.min_nodes, limits.max_nodes, max(1, limits.node_unit), limits.last_call_timeout_s
        )

    def validate(self) -> None:
        """Raise RendezvousError unless 1 <= min <= max nodes, node_unit is in 1..max nodes, and
        some multiple of node_unit lies in min..max."""
        if self.min_nodes < 1:
            raise RendezvousError(f"min nodes must be >= 1, got {self.min_nodes}")
        if self.max_nodes < self.min_nodes:
            raise RendezvousError(
                f"min nodes {self.min_nodes} > max nodes {self.max_nodes}: use --nnodes MIN:MAX "
                "with MIN <= MAX"
            )
        if self.node_unit < 1 or self.node_unit > self.max_nodes:
            raise RendezvousError(f"node_unit must be in 1..max nodes, got {self.node_unit}")
        if (self.max_nodes // self.node_unit) * self.node_unit < self.min_nodes:
            raise RendezvousError(
                f"no multiple of node_unit {self.node_unit} lies in {self.min_nodes}..{self.max_nodes}"
            )


@dataclass(frozen=True)
class Member:
    """A node in a completed round."""

    node_id: str
    node_rank: int
    local_world_size: int
    host: str


@dataclass(frozen=True)
class World:
    """The outcome of one round: members sorted by node rank and where the process-group
    store of this round lives (picked by the node that got rank 0)."""

    round: int
    members: tuple[Member, ...]
    store_host: str
    store_port: int
    _by_id: dict[str, Member] = field(init=False, repr=False, compare=False)
    _offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """Per node rank, the workers of all lower node ranks; the last entry is the world size."""

    def __post_init__(self) -> None:
        # Indexes, so that each of 10,000 nodes asking for its place costs O(1), not O(nodes).
        object.__setattr__(self, "_by_id", {m.node_id: m for m in self.members})
        offsets = [0]
        for m in sorted(self.members, key=lambda m: m.node_rank):
            offsets.append(offsets[-1] + m.local_world_size)
        object.__setattr__(self, "_offsets", tuple(offsets))

    def member(self, node_id: str) -> Member | None:
        """The member with ``node_id``, or None if it is not in this world."""
        return self._by_id.get(node_id)

    @property
    def world_size(self) -> int:
        """Worker processes in the world: the sum of the members' local world sizes."""
        return self._offsets[-1]

    def rank_offset(self, node_rank: int) -> int:
        """Global rank of node ``node_rank``'s first worker: the workers of all lower node ranks."""
        return self._offsets[max(0, min(node_rank, len(self._offsets) - 1))]


@dataclass
class _Joiner:
    node_id: str
    local_world_size: int
    host: str
    store_host: str
    store_port: int
    requested_rank: int
    order: int
    joined_at: float


class RendezvousManager:
    """Rounds of rendezvous; thread-safe; time comes from an injected clock.

    A round closes when max nodes wait, or when the nodes the master expects are all there, or
    when at least min nodes wait and no one joined for `last_call_timeout_s`. The world size is
    the largest multiple of `node_unit` that fits. Ranks are stable: nodes keep their previous
    relative order (requested rank first, then previous rank, then registration order).
    """

    def __init__(
        self, config: RendezvousConfig, store: StateStore, clock: Callable[[], float]
    ) -> None:
        config.validate()
        self.config = config
        self._store = store
        self._clock = clock
        self._lock = threading.Lock()
        self._waiting: dict[str, _Joiner] = {}
        self._last_join = 0.0
        self._world: World | None = None
        self._broken = False
        self._left: set[str] = set()
        """Members of the current world that left it (lost, finished) since it formed."""
        self._previous_rank: dict[str, int] = {}
        saved = store.get_json(_NAMESPACE, "world")
        if saved is not None:
            self._world = World(
                round=saved["round"],
                members=tuple(Member(**m) for m in saved["members"]),
                store_host=saved["store_host"],
                store_port=saved["store_port"],
            )
            self._previous_rank = {m.node_id: m.node_rank for m in self._world.members}

    @property
    def round(self) -> int:
        """Number of the latest closed round; 0 before the first."""
        with self._lock:
            return self._world.round if self._world else 0

    @property
    def world(self) -> World | None:
        """The latest closed round's world, or None before the first; it stays in place when a
        member leaves (the round is then broken and must re-form)."""
        with self._lock:
            return self._world

    def join(
        self,
        node_id: str,
        local_world_size: int,
        host: str,
        store_host: str,
        store_port: int,
        requested_rank: int,
        order: int,
    ) -> int:
        """Put a node into the waiting set; returns the round it waits for."""
        if local_world_size < 1:
            raise RendezvousError(f"local world size must be >= 1, got {local_world_size}")
        with self._lock:
            now = self._clock()
            self._waiting[node_id] = _Joiner(
                node_id, local_world_size, host, store_host, store_port, requested_rank, order, now
            )
            self._last_join = now
            current = self._world.round if self._world else 0
            logger.info(
                "rendezvous: node %s joins round %d (%d waiting)",
                node_id,
                current + 1,
                len(self._waiting),
            )
            return current + 1

    def leave(self, node_id: str, reason: str) -> None:
        """A node is gone (lost, finished): drop it from the waiting set and the world."""
        with self._lock:
            self._waiting.pop(node_id, None)
            if self._world and self._world.member(node_id) is not None:
                self._left.add(node_id)
            if self._world and self._world.member(node_id) is not None and not self._broken:
                self._broken = True
                logger.info(
                    "rendezvous: round %d broken, node %s left (%s)",
                    self._world.round,
                    node_id,
                    reason,
                )

    def get_world(self, node_id: str, expected_nodes: int) -> World | None:
        """The world `node_id` belongs to once its round closed, else None.

        `expected_nodes` is how many live nodes the master knows of: when all of them wait,
        the last-call wait is skipped.
        """
        with self._lock:
            if node_id in self._waiting:
                self._maybe_close(expected_nodes)
            if node_id in self._waiting:
                return None
            if self._world is not None and self._world.member(node_id) is not None:
                return self._world
            return None

    def maybe_close(self, expected_nodes: int) -> World | None:
        """Close the waiting round if it may close now (see the class); returns the new world, or
        None when nothing closed. Called on every join and when the last-call deadline passes."""
        with self._lock:
            before = self._world
            self._maybe_close(expected_nodes)
            return self._world if self._world is not before else None

    def close_deadline(self) -> float | None:
        """When the quiet last call would close the waiting round (a time of the injected clock),
        or None while fewer than min nodes wait."""
        with self._lock:
            if len(self._waiting) < self.config.min_nodes:
                return None
            return self._last_join + self.config.last_call_timeout_s

    def waiting(self) -> list[str]:
        """The nodes waiting for the next round, sorted."""
        with self._lock:
            return sorted(self._waiting)

    def is_waiting(self, node_id: str) -> bool:
        """Whether the node waits for the next round."""
        with self._lock:
            return node_id in self._waiting

    def is_spare(self, node_id: str) -> bool:
        """Whether ``node_id`` waits while a whole round runs at max nodes without it: a hot
        spare, taken in when a member is lost."""
        with self._lock:
            world = self._world
            if node_id not in self._waiting or world is None or self._broken:
                return False
            return self.config.max_nodes - len(world.members) < self.config.node_unit

    def lost_join(self, node_id: str, round: int) -> bool:
        """Whether ``node_id``, which joined for ``round``, is neither waiting nor in a world of
        that round or later: its join was lost (the master restarted since) and must be
        repeated."""
        with self._lock:
            if node_id in self._waiting:
                return False
            return self._world is None or self._world.round < round

    def num_nodes_waiting(self, node_id: str, round: int) -> tuple[int, int]:
        """(nodes whose arrival should make the running world re-form now, latest round)."""
        with self._lock:
            latest = self._world.round if self._world else 0
            if self._broken:
                return max(1, len(self._waiting)), latest
            if not self._waiting:
                return 0, latest
            world = self._world
            if world is not None and any(world.member(n) for n in self._waiting):
                # A known node came back (its workers restarted): everybody re-forms now.
                return len(self._waiting), latest
            current = len(world.members) if world else 0
            room = self.config.max_nodes - current
            unit = self.config.node_unit
            if room >= unit and len(self._waiting) >= unit:
                return len(self._waiting), latest
            return 0, latest

    def _maybe_close(self, expected_nodes: int) -> None:
        n = len(self._waiting)
        cfg = self.config
        if n < cfg.min_nodes:
            return
        quiet = self._clock() - self._last_join >= cfg.last_call_timeout_s
        # In the first round nodes are still arriving, so only max nodes or a quiet last call
        # close it; later, the nodes the master knows to be alive are the ones to wait for.
        everyone_here = self._world is not None and n >= expected_nodes
        # Max nodes wait, but a member of the world that did not leave it has not re-joined
        # yet (its workers still leaving their step): wait for it until the last call, so that
        # a hot spare or a replacement does not take a survivor's place.
        full = n >= cfg.max_nodes and not self._members_on_their_way()
        if not (full or quiet or everyone_here):
            return
        size = (min(n, cfg.max_nodes) // cfg.node_unit) * cfg.node_unit
        if size >= cfg.min_nodes:
            self._close(size)

    def _members_on_their_way(self) -> bool:
        """Whether a member of the current world neither left it nor waits for the next."""
        if self._world is None:
            return False
        return any(
            m.node_id not in self._waiting and m.node_id not in self._left
            for m in self._world.members
        )

    def _close(self, size: int) -> None:
        big = 1 << 30

        def key(j: _Joiner) -> tuple[int, int, int]:
            requested = j.requested_rank if j.requested_rank >= 0 else big
            return (requested, self._previous_rank.get(j.node_id, big), j.order)

        # Prefer nodes of the previous world, then the earliest registered.
        candidates = sorted(
            self._waiting.values(),
            key=lambda j: (j.node_id not in self._previous_rank, j.order),
        )[:size]
        chosen = sorted(candidates, key=key)
        members = tuple(
            Member(j.node_id, rank, j.local_world_size, j.host) for rank, j in enumerate(chosen)
        )
        new_round = (self._world.round if self._world else 0) + 1
        self._world = World(new_round, members, chosen[0].store_host, chosen[0].store_port)
        self._broken = False
        self._left = set()
        self._previous_rank = {m.node_id: m.node_rank for m in members}
        for j in chosen:
            del self._waiting[j.node_id]
        self._store.put_json(
            _NAMESPACE,
            "world",
            {
                "round": new_round,
                "members": [m.__dict__ for m in members],
                "store_host": self._world.store_host,
                "store_port": self._world.store_port,
            },
        )
        shown = ", ".join(f"{m.node_id}=rank{m.node_rank}" for m in members[:_LOGGED_MEMBERS])
        if len(members) > _LOGGED_MEMBERS:
            shown += f", ... ({len(members) - _LOGGED_MEMBERS} more)"
        logger.info(
            "rendezvous: round %d closed with %d nodes (world size %d): %s",
            new_round,
            len(members),
            self._world.world_size,
            shown,
        )
