"""The master's pre-flight part: runs the node check (node_check.py) of each rendezvous round."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from dlrover.api.master import (
    FailureClass,
    NodeCheckJoin,
    NodeCheckReport,
    NodeCheckState,
    NodeCheckTask,
)
from dlrover.master.changes import ChangeFeed, LongPoll
from dlrover.master.node_check import CheckResult, CheckSettings, NodeCheck
from dlrover.master.nodes import NodeTable
from dlrover.master.rendezvous import World

# The job's parts log as the job: their lines were always the job's log, and people (and
# tests/e2e/test_node_check.py) read them as "dlrover.master.job: ...".
logger = logging.getLogger("dlrover.master.job")

Exclude = Callable[[str, FailureClass, str, str], None]
"""Told (node id, failure class, the check's cause, the verdict's summary) for each node the
check excludes: the job records the failure and loses the node."""

Keep = Callable[[str, str], None]
"""Told (node id, the check's cause) for each straggler the check names but keeps (no
``--exclude-straggler``): the job records it, so `dlrover diagnose` lists it all the same."""


class Preflight:
    """The node check of the current round: its joins, tasks, reports and verdict. It serves
    `NodeCheckApi` (the join as `node_check_poll`).

    `checks` is bumped when a check pairs a round, decides or is abandoned (its joins wait on
    it); not on every join, so a round of N nodes costs O(N) wake-ups. Thread-safe under the
    job's lock.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        lock: threading.RLock,
        nodes: NodeTable,
        world: Callable[[], World | None],
        ended: Callable[[], str | None],
        exclude: Exclude,
        keep: Keep,
    ) -> None:
        self._clock = clock
        self._lock = lock
        self._nodes = nodes
        self._world = world
        self._ended = ended
        """How the job ended, or None while it runs."""
        self._exclude = exclude
        self._keep = keep
        self.checks = ChangeFeed()
        self._check: NodeCheck | None = None
        self._checked: set[str] = set()
        """Nodes that passed a node check (a later round checks only if a member is new)."""
        self.words: dict[str, str] = {}
        """node id -> the node check's word on it (`dlrover status`)."""
        self.summary = ""

    def node_check_poll(self, join: NodeCheckJoin) -> LongPoll[NodeCheckTask]:
        """`NodeCheckApi.join_node_check` as a long poll: record the join now (raises for an
        unknown node or a stale incarnation), then wait for the node's task: RUN once the round
        is paired, DONE / REFORM once decided, WAIT when the wait ran out."""
        self._join(join)

        def task() -> NodeCheckTask | None:
            return self.task(join.node_id, join.rdzv_round, join.check_round)

        return LongPoll(
            self.checks,
            task,
            lambda: task() or NodeCheckTask(NodeCheckState.WAIT, join.check_round),
            self.deadline,
        )

    def report_node_check(self, report: NodeCheckReport) -> None:
        """Record a node's result of a check round (`NodeCheckApi`); raises for an unknown node or
        a stale incarnation."""
        self._nodes.get(report.node_id, report.incarnation)
        self._nodes.touch(report.node_id)
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
            self._after_change(before)

    def _join(self, join: NodeCheckJoin) -> None:
        """A member is ready for a round of its rendezvous round's check; the check starts with
        the first join of a closed round's member. A join for an older rendezvous round is
        answered REFORM by `task`."""
        self._nodes.get(join.node_id, join.incarnation)
        self._nodes.touch(join.node_id)
        with self._lock:
            world = self._world()
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
            self._after_change(before)

    def task(self, node_id: str, rdzv_round: int, check_round: int) -> NodeCheckTask | None:
        """What the node must do for ``check_round``; None while the round waits for members,
        REFORM once the job ended or the world changed."""
        with self._lock:
            ended = self._ended()
            if ended is not None:
                return NodeCheckTask(
                    NodeCheckState.REFORM, check_round, summary=f"the job has ended ({ended})"
                )
            check = self._check
            if check is None or check.rdzv_round != rdzv_round:
                return NodeCheckTask(
                    NodeCheckState.REFORM, check_round, summary="the world changed; join again"
                )
            return check.task(node_id, check_round)

    def deadline(self) -> float | None:
        """When the running check round times out (master clock), or None."""
        with self._lock:
            check = self._check
            return check.deadline() if check is not None else None

    def tick(self) -> None:
        """Time out a check round whose deadline passed."""
        with self._lock:
            if self._check is not None and self._check.tick():
                self._after_change()

    def node_left(self, node_id: str, reason: str) -> None:
        """A member of the running check left: the check is abandoned (its round re-forms)."""
        with self._lock:
            check = self._check
            if check is not None and check.verdict is None and node_id in check.members:
                check.abort(f"node {node_id} left ({reason})")
                self.checks.bump()

    def _after_change(self, version: int = -1) -> None:
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
                self.summary = verdict.summary
            for node in check.members:
                if node in verdict.faulty:
                    self.words[node] = "faulty"
                elif node in verdict.stragglers:
                    self.words[node] = f"straggler {verdict.stragglers[node]:.1f}x"
                elif node in verdict.times:
                    self.words[node] = f"ok {verdict.times[node]:.2f}s"
                if node not in verdict.excluded:
                    self._checked.add(node)
            for node in verdict.excluded:
                faulty = node in verdict.faulty
                self._exclude(
                    node,
                    FailureClass.CHECK_FAILED if faulty else FailureClass.STRAGGLER,
                    verdict.faulty[node]
                    if faulty
                    else f"node check: {verdict.stragglers[node]:.1f}x the median check time",
                    verdict.summary,
                )
            for node, factor in verdict.stragglers.items():
                if node not in verdict.excluded:
                    self._keep(node, f"node check: {factor:.1f}x the median check time")
        self.checks.bump()
