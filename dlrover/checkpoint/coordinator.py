"""Cross-node agreement for flash checkpoints: when a step is committed, which step to load."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class CommitCoordinator(Protocol):
    """What the savers of all nodes agree on. A master-backed implementation must:

    - ``report_persisted(step, node_rank, total_nodes)``: record that ``node_rank`` wrote all
      its files of ``step`` (and its ``node_<k>.json``); return True to exactly one caller,
      the one whose report made the count reach ``total_nodes`` (that saver writes the
      manifest and moves ``latest``). Idempotent per (step, node_rank): a retried report
      must not count twice nor make a second caller the committer.
    - ``mark_committed(step)`` / ``wait_committed(step, timeout)``: the committer announces the
      commit; waiters on other nodes return True once ``step`` (or a newer one) is committed,
      False at the deadline.
    - ``agree_load_step(node_rank, total_nodes, local_step, round_id, timeout)``: every node
      calls it once per restart round with the step complete in memory on all its saving ranks
      (None if any is missing/torn). All callers get the same answer: the common step if every
      node reported the same one, else None (then everyone loads from storage). ``round_id``
      (the rendezvous round) keeps answers of different rounds apart.
    """

    def report_persisted(self, step: int, node_rank: int, total_nodes: int) -> bool: ...

    def mark_committed(self, step: int) -> None: ...

    def wait_committed(self, step: int, timeout: float) -> bool: ...

    def agree_load_step(
        self,
        node_rank: int,
        total_nodes: int,
        local_step: int | None,
        round_id: int,
        timeout: float,
    ) -> int | None: ...


class LocalCommitCoordinator:
    """In-process CommitCoordinator: all nodes' savers share one object (one node, or tests)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._reports: dict[int, set[int]] = {}
        self._committers: set[int] = set()
        self._committed = -1
        self._rounds: dict[int, dict[int, int | None]] = {}

    def report_persisted(self, step: int, node_rank: int, total_nodes: int) -> bool:
        with self._cond:
            nodes = self._reports.setdefault(step, set())
            nodes.add(node_rank)
            if len(nodes) >= total_nodes and step not in self._committers:
                self._committers.add(step)
                return True
            return False

    def mark_committed(self, step: int) -> None:
        with self._cond:
            self._committed = max(self._committed, step)
            for old in [s for s in self._reports if s <= step]:
                del self._reports[old]
            self._cond.notify_all()

    def wait_committed(self, step: int, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._committed >= step, timeout)

    def agree_load_step(
        self,
        node_rank: int,
        total_nodes: int,
        local_step: int | None,
        round_id: int,
        timeout: float,
    ) -> int | None:
        deadline = time.monotonic() + timeout
        with self._cond:
            votes = self._rounds.setdefault(round_id, {})
            votes[node_rank] = local_step
            self._cond.notify_all()
            while len(votes) < total_nodes:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None  # a node never answered: nobody loads from memory
                self._cond.wait(left)
            steps = set(votes.values())
            return steps.pop() if len(steps) == 1 else None
