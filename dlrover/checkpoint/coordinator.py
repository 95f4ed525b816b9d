"""Cross-node agreement for flash checkpoints: when a step is committed, which step to load.

`CommitVotes` is the one implementation of the votes. The job master holds one for the whole
job (and persists the committed step); `LocalCommitCoordinator` wraps one for a single node or
a test. Pure Python, no I/O: both the master and the node side import it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

_KEEP_STEPS = 1000
"""Committers of steps older than the newest committed by more than this are forgotten."""
_KEEP_ROUNDS = 8
"""Decided load-step rounds older than the newest by more than this are forgotten."""


class CommitCoordinator(Protocol):
    """What the savers of all nodes agree on (see `CommitVotes` for the rules)."""

    def report_persisted(self, step: int, node_rank: int, total_nodes: int) -> bool:
        """Node ``node_rank`` wrote all its files of ``step``; True for exactly one node of the
        step, the committer (see CommitVotes)."""
        ...

    def mark_committed(self, step: int) -> None:
        """The committer announces that ``step`` is committed; its waiters wake."""
        ...

    def wait_committed(self, step: int, timeout: float) -> bool:
        """Whether ``step`` or a newer one is committed within ``timeout`` seconds."""
        ...

    def agree_load_step(
        self,
        node_rank: int,
        total_nodes: int,
        local_step: int | None,
        round_id: int,
        timeout: float,
    ) -> int | None:
        """The step every node holds complete in memory in restart round ``round_id``, or None (they
        differ, or a node did not vote within ``timeout`` seconds)."""
        ...


class CommitVotes:
    """Thread-safe votes of the nodes' checkpoint savers.

    - ``report_persisted(step, node_rank, total_nodes)``: ``node_rank`` wrote all its files of
      ``step``. Exactly one node per step is the committer: the one whose report made the count
      reach ``total_nodes``; it alone gets True, and asking again gives the same answer (a
      retried report neither counts twice nor makes a second committer).
    - ``mark_committed(step)`` / ``wait_committed(step, timeout)``: the committer announces the
      commit; waiters return True once ``step`` or a newer one is committed, False at the
      deadline. ``on_committed`` is told each newer committed step (the master persists it).
    - ``agree_load_step(...)``: every node votes once per restart round (``round_id``) with the
      step complete in memory on all its saving ranks (None if any is missing or torn). Once
      all ``total_nodes`` voted, every caller of that round gets the same decision: the common
      step if all voted the same, else None (then everyone loads from storage).
    """

    def __init__(
        self, committed: int = -1, on_committed: Callable[[int], None] | None = None
    ) -> None:
        self._cond = threading.Condition()
        self._reports: dict[int, set[int]] = {}
        self._committer: dict[int, int] = {}
        self._committed = committed
        self._on_committed = on_committed
        self._votes: dict[int, dict[int, int | None]] = {}
        self._decided: dict[int, int | None] = {}
        self._closed = False

    def close(self) -> None:
        """The master stops: every wait returns now with what is known (a blocked wait would
        hold the exiting process for its whole deadline)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def report_persisted(self, step: int, node_rank: int, total_nodes: int) -> bool:
        """True for exactly one node of ``step``: the one whose report completed it."""
        with self._cond:
            nodes = self._reports.setdefault(step, set())
            nodes.add(node_rank)
            if step not in self._committer and len(nodes) >= total_nodes:
                if step <= self._committed:
                    return False  # committed already, and its committer forgotten: not this one
                self._committer[step] = node_rank
            return self._committer.get(step) == node_rank

    def mark_committed(self, step: int) -> None:
        """``step`` is committed: wake its waiters and forget the reports up to it."""
        with self._cond:
            if step > self._committed:
                self._committed = step
                if self._on_committed is not None:
                    self._on_committed(step)
            for old in [s for s in self._reports if s <= step]:
                del self._reports[old]
            # A retried report of a recent step still gets its answer; older ones are forgotten.
            for old in [s for s in self._committer if s < step - _KEEP_STEPS]:
                del self._committer[old]
            self._cond.notify_all()

    def wait_committed(self, step: int, wait_s: float) -> bool:
        """Whether ``step`` (or a newer one) is committed within ``wait_s`` seconds."""
        with self._cond:
            self._cond.wait_for(lambda: self._committed >= step or self._closed, max(wait_s, 0.0))
            return self._committed >= step

    # The master serves `dlrover.api.master.CheckpointApi` with these.
    checkpoint_persisted = report_persisted
    checkpoint_committed = mark_committed
    wait_checkpoint_committed = wait_committed

    def vote_load_step(
        self,
        node_rank: int,
        total_nodes: int,
        local_step: int | None,
        round_id: int,
        wait_s: float,
    ) -> tuple[bool, int | None]:
        """Cast (or repeat) a vote and wait up to ``wait_s`` for the round's decision:
        ``(decided, step)``; ``(False, None)`` while some node has not voted."""
        with self._cond:
            if round_id not in self._decided:
                votes = self._votes.setdefault(round_id, {})
                votes[node_rank] = local_step
                if len(votes) >= total_nodes:
                    steps = set(votes.values())
                    self._decided[round_id] = steps.pop() if len(steps) == 1 else None
                    del self._votes[round_id]
                    for old in [r for r in self._decided if r < round_id - _KEEP_ROUNDS]:
                        del self._decided[old]
                    self._cond.notify_all()
            self._cond.wait_for(lambda: round_id in self._decided or self._closed, max(wait_s, 0.0))
            if round_id not in self._decided:
                return False, None
            return True, self._decided[round_id]

    def agree_load_step(
        self,
        node_rank: int,
        total_nodes: int,
        local_step: int | None,
        round_id: int,
        timeout: float,
    ) -> int | None:
        """The round's common step, or None (they differ, or a node never voted in time)."""
        return self.vote_load_step(node_rank, total_nodes, local_step, round_id, timeout)[1]


class LocalCommitCoordinator(CommitVotes):
    """In-process CommitCoordinator: all nodes' savers share one object (one node, or tests)."""
