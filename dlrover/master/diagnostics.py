"""The master's diagnostics part: the failure log, runtime stragglers, goodput and the timeline."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from dlrover.api.master import FailureClass, FailureRecord, HeartbeatReport
from dlrover.decisions import NO_ACTION
from dlrover.master import diagnosis
from dlrover.master.goodput import GoodputTracker, StepSample
from dlrover.master.nodes import NodeError, NodeTable
from dlrover.master.rendezvous import World
from dlrover.master.state_store import StateStore
from dlrover.master.stragglers import Score, StragglerWatch

# The job's parts log as the job: their lines were always the job's log, and people (and
# tests/e2e/test_node_check.py) read them as "dlrover.master.job: ...".
logger = logging.getLogger("dlrover.master.job")

MAX_EVENTS = 500
"""Timeline events kept (`Diagnostics.events`)."""


class Diagnostics:
    """What the master observed and concluded about the job, kept for people and tools. It
    serves `DiagnosticsApi`.

    Failures are kept in the state (`dlrover diagnose` reads them after the master is gone, see
    dlrover/master/diagnosis.py); the timeline, the straggler scores and goodput live in memory.
    It decides which runtime stragglers to replace and queues them (`take_replacements`); it
    acts on nothing itself. Thread-safe under the job's lock.
    """

    def __init__(
        self,
        store: StateStore,
        clock: Callable[[], float],
        lock: threading.RLock,
        straggler_report_s: float,
        nodes: NodeTable,
    ) -> None:
        self._store = store
        self._clock = clock
        self._lock = lock
        self._nodes = nodes
        """Whose failures are reported, and their worker restarts so far."""
        saved = diagnosis.load_kept(store)
        self._failures = [record for _, record, _ in saved]
        self._prints = [print_ for _, _, print_ in saved]
        """Each kept failure's `diagnosis.cause_print`, in step with ``_failures``."""
        self._folds = diagnosis.load_folds(store)
        """The failures dropped from ``_failures`` (beyond MAX_FAILURES), folded: every failure
        the job had stays counted, in bounded form."""
        self._fold_written: dict[diagnosis.FoldKey, float] = {}
        self._fold_dirty: set[diagnosis.FoldKey] = set()
        self._failure_seq = saved[-1][0] if saved else 0
        self._unlinked: dict[int, FailureRecord] = {}
        """Failures recorded since the last round formed, by sequence number: the next round
        is the one they led to (`link_round`). A restarted master links none of the saved ones:
        rounds may have formed while it was away."""
        self.stragglers = StragglerWatch(clock, straggler_report_s)
        self.goodput = GoodputTracker(clock(), on_recovered=self._recovered)
        """Live goodput and badput (metrics, dashboard, status)."""
        self.events: deque[tuple[float, str, str]] = deque(maxlen=MAX_EVENTS)
        """(wall time, kind, text) of the job's latest events: rounds, failures, state changes,
        scale plans (the dashboard's timeline); in memory only."""
        self._replace: list[tuple[str, str]] = []
        self.on_recorded: list[Callable[[FailureRecord], object]] = []
        """Told of every failure recorded, outside the lock (the lifecycle: a held job failure
        waits for its round's root cause; the same root cause twice in a row fails the job)."""
        self.scale_summary = ""
        """The auto-scaler's latest plan in one line (`dlrover status`)."""

    # --- the timeline and the failure log ---------------------------------------------------
    def event(self, kind: str, text: str) -> None:
        """Add ``text`` to the timeline (kinds: round, failure, collateral (a node's failure on a
        peer's error), job, scale, node, ckpt)."""
        self.events.append((time.time(), kind, text))

    def record_failure(self, record: FailureRecord) -> None:
        """Keep a classified failure (in the state: it outlives the master) and log it. Its
        root cause is kept bounded (`diagnosis.bounded_cause`), so a storm of reports with
        long stacks costs the master bounded memory."""
        print_ = diagnosis.cause_print(record.root_cause)
        if len(record.root_cause) > diagnosis.MAX_CAUSE_CHARS:
            record = dataclasses.replace(
                record, root_cause=diagnosis.bounded_cause(record.root_cause)
            )
        self.goodput.on_failure(record.action)
        # A node's failure on a peer's error is that peer's failure seen again: its own kind,
        # so that the charts mark one failure per failure, whichever node reports first.
        self.event(
            "collateral" if record.failure_class is FailureClass.COLLATERAL else "failure",
            f"{record.node_id}: {record.failure_class.value} -> {record.action}: "
            f"{record.root_cause.splitlines()[0][:200] if record.root_cause else ''}",
        )
        with self._lock:
            self._failure_seq += 1
            self._failures.append(record)
            self._prints.append(print_)
            self._store.put_json(
                diagnosis.NAMESPACE,
                diagnosis.key(self._failure_seq),
                diagnosis.kept_to_json(record, print_),
            )
            if not record.round:
                self._unlinked[self._failure_seq] = record
            if len(self._failures) > diagnosis.MAX_FAILURES:
                dropped = self._failures.pop(0)
                self._fold_in(dropped, self._prints.pop(0))
                oldest = self._failure_seq - diagnosis.MAX_FAILURES
                self._store.delete(diagnosis.NAMESPACE, diagnosis.key(oldest))
                if self._unlinked.get(oldest) is dropped:
                    del self._unlinked[oldest]
        logger.info(
            "failure of node %s: %s -> %s: %s",
            record.node_id,
            record.failure_class.value,
            record.action,
            record.root_cause.splitlines()[0] if record.root_cause else "",
        )
        for listener in self.on_recorded:
            listener(record)

    def _fold_in(self, record: FailureRecord, print_: str) -> None:
        """Count a failure dropped from the kept ones into its fold (under the lock); the fold
        is written to the state when it is new, then at most once a second (and by `flush`)."""
        k = diagnosis.fold_key(record, print_)
        fold = self._folds.get(k)
        if fold is None:
            self._folds[k] = diagnosis.fold([(record, print_)])[k]
            if len(self._folds) > diagnosis.MAX_FOLDS:
                stale = min(self._folds, key=lambda key: self._folds[key].record.at)
                self._drop_fold(stale)
        else:
            fold.add(record)
        self._fold_dirty.add(k)
        now = self._clock()
        if now - self._fold_written.get(k, -1e9) >= 1.0:
            self._write_fold(k, now)

    def _drop_fold(self, k: diagnosis.FoldKey) -> None:
        del self._folds[k]
        self._fold_written.pop(k, None)
        self._fold_dirty.discard(k)
        self._store.delete(diagnosis.FOLDS_NAMESPACE, diagnosis.fold_state_key(k))

    def _write_fold(self, k: diagnosis.FoldKey, now: float) -> None:
        self._store.put_json(
            diagnosis.FOLDS_NAMESPACE,
            diagnosis.fold_state_key(k),
            diagnosis.fold_to_json(k, self._folds[k]),
        )
        self._fold_written[k] = now
        self._fold_dirty.discard(k)

    def flush(self) -> None:
        """Write every fold counted since it was last written (the master's tick calls it)."""
        with self._lock:
            now = self._clock()
            for k in list(self._fold_dirty):
                self._write_fold(k, now)

    def last_cause(self, node_id: str) -> str:
        """The root cause of the newest failure recorded for ``node_id`` ("" for none): what its
        agent reported before the node ended."""
        with self._lock:
            for record in reversed(self._failures):
                if record.node_id == node_id and record.root_cause:
                    return record.root_cause.splitlines()[0]
        return ""

    def current_failures(self) -> list[FailureRecord]:
        """The failures recorded since the last round formed, oldest first."""
        with self._lock:
            return list(self._unlinked.values())

    def round_cause(self, node_id: str) -> tuple[bool, FailureRecord | None]:
        """Whether ``node_id``'s newest failure since the last round formed is collateral (a
        peer's failure broke its workers), and the round's root cause then: its earliest
        failure of another class, from any node (None: none reported yet)."""
        with self._lock:
            current = list(self._unlinked.values())
        own = [r for r in current if r.node_id == node_id]
        if not own or own[-1].failure_class is not FailureClass.COLLATERAL:
            return False, None
        causes = [
            r
            for r in current
            if r.failure_class is not FailureClass.COLLATERAL and r.action != NO_ACTION
        ]
        return True, min(causes, key=lambda r: r.at) if causes else None

    def repeated_cause(self, record: FailureRecord) -> FailureRecord | None:
        """The previous failed round's root cause when ``record`` (a failure of the current
        round) is the same user error: same signature, whichever node raised either."""
        if record.failure_class is not FailureClass.USER_ERROR or not record.signature:
            return None
        with self._lock:
            linked = [r for r in self._failures if r.round > 0]
            if not linked:
                return None
            last = max(r.round for r in linked)
            before = [
                r
                for r in linked
                if r.round == last
                and r.failure_class is not FailureClass.COLLATERAL
                and r.action != NO_ACTION
            ]
        if not before:
            return None
        cause = min(before, key=lambda r: r.at)
        return cause if cause.signature == record.signature else None

    def report_failure(self, node_id: str, incarnation: int, record: FailureRecord) -> None:
        """A node's agent reports a classified failure of its workers (`DiagnosticsApi`); raises
        for an unknown node or a stale incarnation."""
        self._nodes.get(node_id, incarnation)
        self.record_failure(record)

    def link_round(self, round: int) -> None:
        """A round formed: it is the one every failure recorded since the previous round led
        to (each record says so, in the state too)."""
        with self._lock:
            # The kept failures are consecutive by sequence number, the newest last: O(1) each
            # (a storm of lost nodes links up to MAX_FAILURES records under the job's lock).
            first = self._failure_seq - len(self._failures) + 1
            for seq, record in self._unlinked.items():
                linked = dataclasses.replace(record, round=round)
                i = seq - first
                if not (0 <= i < len(self._failures) and self._failures[i] is record):
                    continue  # dropped meanwhile (and out of ``_unlinked`` then: never here)
                self._failures[i] = linked
                self._store.put_json(
                    diagnosis.NAMESPACE,
                    diagnosis.key(seq),
                    diagnosis.kept_to_json(linked, self._prints[i]),
                )
            self._unlinked.clear()
            # Folds of failures dropped before this round formed led to it too.
            for k in [k for k in self._folds if k[2] == 0]:
                fold = self._folds[k]
                self._drop_fold(k)
                relinked = (k[0], k[1], round, k[3])
                fold.record = dataclasses.replace(fold.record, round=round)
                if relinked in self._folds:
                    self._folds[relinked].merge(fold)
                else:
                    self._folds[relinked] = fold
                self._write_fold(relinked, self._clock())

    def _recovered(self, round: int, seconds: float) -> None:
        """The job went past its last step before ``round``, ``seconds`` after its last progress
        then: what the failures that led to ``round`` cost (kept in the state too, so that
        `dlrover diagnose` of an ended job shows it)."""
        with self._lock:
            first = self._failure_seq - len(self._failures) + 1
            for i, record in enumerate(self._failures):
                if record.round == round and not record.cost_s:
                    costed = dataclasses.replace(record, cost_s=seconds)
                    self._failures[i] = costed
                    self._store.put_json(
                        diagnosis.NAMESPACE,
                        diagnosis.key(first + i),
                        diagnosis.kept_to_json(costed, self._prints[i]),
                    )

    def record(self, node_id: str, cls: FailureClass, action: str, cause: str) -> None:
        """`record_failure` of a failure observed now, with the node's restarts so far."""
        try:
            restarts = self._nodes.get(node_id).restart_count
        except NodeError:
            restarts = 0
        self.record_failure(FailureRecord(time.time(), node_id, cls, action, cause, restarts))

    def failures(self) -> tuple[FailureRecord, ...]:
        """The last MAX_FAILURES failures, one by one, oldest first, each with what it cost
        once the job got past it (see `_recovered`)."""
        with self._lock:
            return tuple(self._failures)

    def get_failures(self) -> tuple[FailureRecord, ...]:
        """Every failure the job had, folded (`DiagnosticsApi.get_failures`, `dlrover
        diagnose`): failures of one class, action and round whose root causes differ in numbers
        only are one record with their count, first time and number of nodes; in order of
        first occurrence. As long as the job has distinct failures, not as long as it has
        failures: a storm of the same error from every node is one record."""
        with self._lock:
            return diagnosis.folded(
                self._folds, list(zip(self._failures, self._prints, strict=True))
            )

    def scale_plan(self, summary: str, event: str = "") -> None:
        """The auto-scaler's new plan: ``summary`` for the status, ``event`` (when it acts) for
        the timeline."""
        self.scale_summary = summary
        if event:
            self.event("scale", event)

    # --- runtime stragglers ------------------------------------------------------------------
    def observe_heartbeat(self, report: HeartbeatReport, world: World | None) -> None:
        """A heartbeat (`Membership.on_heartbeat`): the workers' progress counts for goodput while
        the node is a member of the latest world; its step time is scored at the next straggler
        report."""
        sample = StepSample.of(report)
        if sample is not None and world is not None and world.member(report.node_id) is not None:
            self.goodput.on_progress(self._clock(), world.round, sample)
        if report.step_time_s > 0:
            self.observe_step_time(report.node_id, report.step_time_s)

    def observe_step_time(self, node_id: str, step_time_s: float) -> None:
        """A node's latest step time (scored at the next straggler report)."""
        with self._lock:
            self.stragglers.observe(node_id, step_time_s)

    def forget(self, node_id: str) -> None:
        """The node left the job: its replacement starts with no straggler history."""
        with self._lock:
            self.stragglers.forget(node_id)

    def score_stragglers(self, running: list[str], replace: bool) -> list[str]:
        """A straggler report over the ``running`` members of the round: each node newly below
        the threshold for the set number of reports is queued for replacement (``replace``,
        `--exclude-straggler`) or recorded as kept. Returns the nodes queued."""
        scores, new = self.stragglers.report(running)
        if len(scores) < 2:
            return []
        logger.info("straggler scores: %s", ", ".join(s.describe() for s in scores))
        watch = self.stragglers
        queued = []
        for node in new:
            score = watch.scores[node]
            action = "replacing it" if replace else "kept (no --exclude-straggler)"
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
            if replace:
                queued.append(node)
                self._replace.append((node, cause))  # the controller records what it did
            else:
                self.record(node, FailureClass.STRAGGLER, NO_ACTION, cause)
        return queued

    def straggler_scores(self) -> dict[str, Score]:
        """A copy of the latest straggler report's scores by node."""
        with self._lock:
            return dict(self.stragglers.scores)

    def take_replacements(self) -> list[tuple[str, str]]:
        """(node, why) to replace as stragglers since the last call."""
        with self._lock:
            taken, self._replace = self._replace, []
            return taken
