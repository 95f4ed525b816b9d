"""The master's side of flash-checkpoint commits: which node commits a step, which step to load."""

from __future__ import annotations

import threading

from dlrover.master.state_store import StateStore

MAX_WAIT_S = 10.0
"""A server-side wait is capped; clients ask again until their own deadline."""
_NAMESPACE = "checkpoint"


class CheckpointCoordination:
    """Thread-safe votes of the nodes' checkpoint savers.

    Invariants: for each step, exactly one node is the committer (the one whose report made
    the count reach the total; asking again gives the same answer); every node voting in one
    restart round gets the same load step.
    """

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._cond = threading.Condition()
        self._reports: dict[int, set[int]] = {}
        self._committer: dict[int, int] = {}
        self._committed = int(store.get_json(_NAMESPACE, "committed") or -1)
        self._votes: dict[int, dict[int, int | None]] = {}
        self._decided: dict[int, int | None] = {}

    def report_persisted(self, step: int, node_rank: int, total_nodes: int) -> bool:
        with self._cond:
            nodes = self._reports.setdefault(step, set())
            nodes.add(node_rank)
            if step not in self._committer and len(nodes) >= total_nodes:
                self._committer[step] = node_rank
            return self._committer.get(step) == node_rank

    def mark_committed(self, step: int) -> None:
        with self._cond:
            if step > self._committed:
                self._committed = step
                self._store.put_json(_NAMESPACE, "committed", step)
            for old in [s for s in self._reports if s <= step]:
                del self._reports[old]
            self._cond.notify_all()

    def wait_committed(self, step: int, wait_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(
                lambda: self._committed >= step, timeout=min(max(wait_s, 0.0), MAX_WAIT_S)
            )

    def agree_load_step(
        self, node_rank: int, total_nodes: int, local_step: int | None, round_id: int, wait_s: float
    ) -> tuple[bool, int | None]:
        """(decided, step): the common step once every node voted, None if they differ."""
        with self._cond:
            if round_id not in self._decided:
                votes = self._votes.setdefault(round_id, {})
                votes[node_rank] = local_step
                if len(votes) >= total_nodes:
                    steps = set(votes.values())
                    self._decided[round_id] = steps.pop() if len(steps) == 1 else None
                    del self._votes[round_id]
                    for old in [r for r in self._decided if r < round_id - 8]:
                        del self._decided[old]
                    self._cond.notify_all()
            self._cond.wait_for(
                lambda: round_id in self._decided, timeout=min(max(wait_s, 0.0), MAX_WAIT_S)
            )
            if round_id not in self._decided:
                return False, None
            return True, self._decided[round_id]
