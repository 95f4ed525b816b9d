"""The master's lifecycle part: the job's state and how it ends (the exit barrier, a stop)."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from dlrover.api.master import JobStatus, NodeOutcome, NodeReport
from dlrover.master.changes import LongPoll
from dlrover.master.membership import NAMESPACE, Membership
from dlrover.master.nodes import NodeState
from dlrover.master.rendezvous import World
from dlrover.master.state_store import StateStore

# The job's parts log as the job (people and tests read "dlrover.master.job: ...").
logger = logging.getLogger("dlrover.master.job")


ROOT_CAUSE_WAIT_S = 5.0
"""How long a node's failure on a peer's error (collateral) holds the job's failure back while
the round's root cause, another node's own failure, is not reported yet."""

RoundCause = Callable[[str], "tuple[bool, str]"]
"""node id -> whether its newest failure is collateral, and its round's root cause ("": none
reported yet): `Diagnostics.round_cause` in words."""


@dataclass(frozen=True)
class _HeldFailure:
    node_id: str
    reason: str
    exit_code: int
    until: float
    """Monotonic time the job fails at anyway."""


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


class JobLifecycle:
    """The job's state (saved: it outlives the master), and every way the job ends: all members
    succeeded, a node failed, every node was lost, a round that can never form, a stop from
    outside, a chief that finished. It serves `LifecycleApi` (the exit barrier as `exit_poll`).

    `ended` is set once, when the job ends: the `on_end` listeners (goodput) are told just before,
    the `on_failed` ones (the node check) just after a failure, and the membership feeds are
    bumped so every long poll answers.
    """

    def __init__(
        self,
        job_name: str,
        store: StateStore,
        lock: threading.RLock,
        ended: threading.Event,
        members: Membership,
        event: Callable[[str, str], None],
        status: Callable[[], JobStatus],
        round_cause: RoundCause | None = None,
    ) -> None:
        self._job_name = job_name
        self._round_cause = round_cause
        self._held: _HeldFailure | None = None
        self._store = store
        self._lock = lock
        self._members = members
        self._event = event
        self._status = status
        saved = store.get_json(NAMESPACE, "state") or {}
        self.state = JobState(saved.get("state", JobState.PENDING.value))
        self.reason: str = saved.get("reason", "")
        self.exit_code: int = saved.get("exit_code", 0)
        self.ended = ended
        if self.state in (JobState.SUCCEEDED, JobState.FAILED):
            ended.set()
        self.on_end: list[Callable[[], object]] = []
        """Told once, as the job ends, before `ended` is set (goodput closes its books)."""
        self.on_failed: list[Callable[[], object]] = []
        """Told once the job failed, after `ended` is set (a node check under way ends)."""

    def ended_as(self) -> str | None:
        """How the job ended (a `JobState` value), or None while it runs."""
        return self.state.value if self.ended.is_set() else None

    # --- LifecycleApi ---------------------------------------------------------------------------
    def exit_poll(self, report: NodeReport) -> LongPoll[bool]:
        """`LifecycleApi.report_node_status` as a long poll: record the report now (idempotent),
        then wait for the job's end: True once it succeeded (the exit barrier)."""
        done = self.report_now(report)

        def check() -> bool | None:
            return self.state == JobState.SUCCEEDED if self.ended.is_set() else None

        return LongPoll(self._members.rounds, lambda: True if done else check(), lambda: False)

    def report_now(self, report: NodeReport) -> bool:
        """An agent finished: its node succeeded (the job succeeds with its last member) or failed
        (so does the job). Returns True once the job has succeeded."""
        nodes = self._members.nodes
        nodes.get(report.node_id, report.incarnation)
        with self._lock:
            if report.outcome is NodeOutcome.SUCCEEDED:
                nodes.set_state(
                    report.node_id, NodeState.SUCCEEDED, report.reason or "workers succeeded"
                )
                self._check_success()
                self.fail_if_unformable()
            else:
                nodes.set_state(report.node_id, NodeState.FAILED, report.reason or "workers failed")
                nodes.set_exit_code(report.node_id, report.exit_code)
                self._node_failed(
                    report.node_id,
                    f"node {report.node_id} failed: {report.reason}",
                    report.exit_code or 1,
                )
            return self.state == JobState.SUCCEEDED

    def _node_failed(self, node_id: str, reason: str, exit_code: int) -> None:
        """A node failed, so does the job, naming the root cause: a node that failed on a
        peer's error (its last failure collateral) is not the cause while another node's own
        failure of the same round exists, whatever order the reports came in. Until that one is
        reported, at most ROOT_CAUSE_WAIT_S, the job's failure is held (`recheck_held`)."""
        if self._round_cause is None or self.ended.is_set():
            self._fail(reason, exit_code)
            return
        collateral, root = self._round_cause(node_id)
        if not collateral:
            self._fail(reason, exit_code)
        elif root:
            self._fail(f"{reason}; root cause: {root}", exit_code)
        elif self._held is None:
            self._held = _HeldFailure(
                node_id, reason, exit_code, time.monotonic() + ROOT_CAUSE_WAIT_S
            )
            logger.info(
                "job %s: node %s failed on a peer's error; waiting up to %.0f s for the "
                "round's root cause",
                self._job_name,
                node_id,
                ROOT_CAUSE_WAIT_S,
            )

    def recheck_held(self, *_: object) -> None:
        """A failure was recorded, or the tick: end a held job failure once its round's root
        cause is known or the wait is over."""
        with self._lock:
            held = self._held
            if held is None or self.ended.is_set():
                return
            assert self._round_cause is not None
            _collateral, root = self._round_cause(held.node_id)
            if root:
                self._held = None
                self._fail(f"{held.reason}; root cause: {root}", held.exit_code)
            elif time.monotonic() >= held.until:
                self._held = None
                self._fail(
                    f"{held.reason} (a peer's error; no other node reported its own failure "
                    f"within {ROOT_CAUSE_WAIT_S:.0f} s)",
                    held.exit_code,
                )

    def stop_job(self, reason: str) -> JobStatus:
        """Fail the job with ``reason`` ("stopped by request" if empty) and return its status."""
        self.stop(reason or "stopped by request")
        return self._status()

    # --- from the master's other parts and its host -----------------------------------------------
    def stop(self, reason: str) -> None:
        """End the job from outside (e.g. SIGTERM to the master)."""
        with self._lock:
            self._fail(reason, 1)

    def mark_running(self, reason: str) -> None:
        """PENDING -> RUNNING from outside: a job without rounds (TensorFlow) started."""
        with self._lock:
            if self.state is JobState.PENDING and not self.ended.is_set():
                self._set_state(JobState.RUNNING, reason)

    def succeed(self, reason: str) -> None:
        """End the job as succeeded from outside: a job whose end is one node's, not its agents'
        exit barrier (the chief of a TensorFlow job, dlrover/master/tf_controller.py)."""
        with self._lock:
            if not self.ended.is_set():
                self._succeed(reason)

    def on_round(self, world: World) -> None:
        """A round closed: a pending job is RUNNING."""
        if self.state == JobState.PENDING:
            self._set_state(JobState.RUNNING, f"round {world.round} formed")

    def fail_if_unformable(self) -> None:
        """Fail the job when its waiting round can never close (`Membership.unformable`)."""
        with self._lock:
            why = self._members.unformable()
            if why:
                self._fail(why, 1)

    def check_end(self) -> None:
        """The tick's look at the job's end: every node lost with no replacement on its way
        fails it; a running job succeeds with its last member, or fails on a round that can never
        form."""
        members = self._members
        self.recheck_held()
        with self._lock:
            if self.ended.is_set():
                return
            if (
                not members.expecting()
                and members.alive() == 0
                and members.nodes.count(NodeState.LOST) > 0
            ):
                self._fail("every node was lost", 1)
            elif self.state == JobState.RUNNING:
                self._check_success()
                self.fail_if_unformable()

    # --- the end ------------------------------------------------------------------------------
    def _check_success(self) -> None:
        world = self._members.world()
        if world is None or self.ended.is_set():
            return
        nodes = self._members.nodes
        if nodes.count(NodeState.SUCCEEDED) < len(world.members):
            return  # not yet: the scan below is O(nodes), this count O(1)
        states = [nodes.get(m.node_id).state for m in world.members]
        if all(s == NodeState.SUCCEEDED for s in states):
            self._succeed(f"all {len(states)} nodes succeeded")

    def _succeed(self, reason: str) -> None:
        self._set_state(JobState.SUCCEEDED, reason)
        self.exit_code = 0
        self._end()

    def _fail(self, reason: str, exit_code: int) -> None:
        if self.ended.is_set():
            return
        self.exit_code = exit_code
        self._set_state(JobState.FAILED, reason)
        self._end()
        for listener in self.on_failed:
            listener()

    def _end(self) -> None:
        self._save()
        for listener in self.on_end:
            listener()
        self.ended.set()
        self._members.rounds.bump()
        self._members.changes.bump()

    def _set_state(self, new: JobState, reason: str) -> None:
        logger.info("job %s: %s -> %s (%s)", self._job_name, self.state.value, new.value, reason)
        self.state = new
        self.reason = reason
        self._event("job", f"{new.value}: {reason}")
        self._save()

    def _save(self) -> None:
        self._store.put_json(
            NAMESPACE,
            "state",
            {"state": self.state.value, "reason": self.reason, "exit_code": self.exit_code},
        )
