"""`MasterApi` on a JobMaster in this process: the calls' rules in domain types.

The gRPC handlers (`server.py`, derived from `MasterApi`) call this; an embedded master or a test
can hand it to an agent directly, with no server and no processes in between.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

from dlrover.api import master as api
from dlrover.api.errors import MasterRequestError, UnknownNodeError
from dlrover.constants import MAX_LONG_POLL_S
from dlrover.master.changes import ChangeFeed
from dlrover.master.goodput import StepSample
from dlrover.master.job import JobMaster, JobState
from dlrover.master.kv_store import KvError
from dlrover.master.nodes import NodeError
from dlrover.master.nodes import UnknownNodeError as UnknownNode
from dlrover.master.rendezvous import RendezvousConfig, RendezvousError

T = TypeVar("T")


@contextmanager
def _refusals() -> Iterator[None]:
    """The master's own errors become the API's: the caller sees what the gRPC client sees."""
    try:
        yield
    except UnknownNode as e:
        raise UnknownNodeError(str(e)) from None
    except (NodeError, RendezvousError, KvError, ValueError) as e:
        raise MasterRequestError(str(e)) from None


class LongPoll(Generic[T]):
    """One long poll: which change feed wakes it, what it answers once there is something to
    say (``check`` returns None while there is not), what it answers when the wait runs out,
    and when it must look again without a wake-up (a rendezvous round's last call)."""

    def __init__(
        self,
        feed: ChangeFeed,
        check: Callable[[], T | None],
        on_timeout: Callable[[], T],
        wake_at: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.feed = feed
        self.check = check
        self.on_timeout = on_timeout
        self.wake_at = wake_at

    def sleep_s(self, left_s: float, now: float) -> float:
        """How long to wait for a bump before looking again: the time ``left_s`` of the hold,
        or until `wake_at` (``now`` on the same clock); a last call that is over but closed
        nothing is looked at again in 50 ms, never in a busy loop."""
        wake = self.wake_at()
        if wake is None:
            return left_s
        return min(left_s, max(0.05, wake - now))


def hold_s(wait_s: float) -> float:
    """How long the master holds a long poll that asked for ``wait_s``: at most a random 50-100%
    of MAX_LONG_POLL_S, so that the watches of 10,000 nodes armed in the same second do not all
    come back in the same second ever after."""
    return max(0.0, min(wait_s, MAX_LONG_POLL_S * random.uniform(0.5, 1.0)))


class LocalMasterApi:
    """Implements `dlrover.api.master.MasterApi` by calling the JobMaster directly.

    The long polls (`get_comm_world`, `num_nodes_waiting`, `report_node_status` with a
    ``wait_s``) block the calling thread here; the gRPC server runs the same `LongPoll`s on its
    event loop instead, so that 10,000 held calls cost no threads.
    """

    def __init__(self, job: JobMaster) -> None:
        self.job = job

    def _hold(self, poll: LongPoll[T], wait_s: float) -> T:
        """Run ``poll`` in this thread for at most hold_s(``wait_s``) seconds."""
        deadline = time.monotonic() + hold_s(wait_s)
        while True:
            version = poll.feed.version
            answer = poll.check()
            if answer is not None:
                return answer
            now = time.monotonic()
            if now >= deadline:
                return poll.on_timeout()
            poll.feed.wait(version, poll.sleep_s(deadline - now, self.job.now()))

    def register_node(self, registration: api.Registration) -> api.Registered:
        """Admit the agent (see MasterApi.register_node); also refuses a ``local_world_size`` below
        1 and a first registration without limits."""
        r = registration
        with _refusals():
            if r.local_world_size < 1:
                raise ValueError(f"local_world_size must be >= 1, got {r.local_world_size}")
            rdzv = None
            if r.limits is not None:
                rdzv = RendezvousConfig(
                    min_nodes=r.limits.min_nodes,
                    max_nodes=r.limits.max_nodes,
                    node_unit=max(1, r.limits.node_unit),
                    last_call_timeout_s=r.limits.last_call_timeout_s,
                )
            node = self.job.register(
                r.node_id, r.host, r.role, r.local_world_size, r.requested_rank, r.pid, rdzv
            )
            have = self.job.rendezvous_config()
        return api.Registered(
            node_id=node.node_id,
            incarnation=node.incarnation,
            limits=api.NodeLimits(
                have.min_nodes, have.max_nodes, have.node_unit, have.last_call_timeout_s
            ),
            job_name=self.job.config.job_name,
            heartbeat_interval_s=self.job.heartbeat_interval_s(),
        )

    def heartbeat(self, report: api.HeartbeatReport) -> api.HeartbeatReply:
        """Record the heartbeat; answer the action (none, stop or reregister) and the job's
        state."""
        with _refusals():
            action = self.job.heartbeat(
                report.node_id,
                report.incarnation,
                report.step,
                report.cpu_percent,
                report.memory_bytes,
                report.restart_count,
                report.step_time_s,
                StepSample.of(report),
                (report.step_wall_s, report.step_data_s, report.step_checkpoint_s),
                report.checkpoint_persist_s,
                report.worker_pids,
            )
        return api.HeartbeatReply(
            api.HeartbeatAction(action), self.job.state.value, self.job.heartbeat_interval_s()
        )

    def join_rendezvous(self, request: api.JoinRequest) -> int:
        """Put the node into the next round and return that round's number; shards its workers held
        go back to the queues. Refused once the job has ended."""
        with _refusals():
            return self.job.join(
                request.node_id,
                request.incarnation,
                request.local_world_size,
                request.store_host,
                request.store_port,
            )

    def get_comm_world(self, node_id: str, round: int, wait_s: float = 0.0) -> api.CommWorld:
        """The node's world once its round closed, with this node's rank and global rank offset.
        Incomplete, ``rejoin`` is set when the master does not know the node to wait for
        ``round`` (the round its join returned): it restarted since. No incarnation is checked.
        ``wait_s``: see `comm_world_poll`."""
        return self._hold(self.comm_world_poll(node_id, round), wait_s)

    def comm_world_poll(self, node_id: str, round: int) -> LongPoll[api.CommWorld]:
        """The long poll of a node waiting for its round: it ends when the round closes, when
        the node must join again, or when the job ended."""

        def check() -> api.CommWorld | None:
            world = self.comm_world_now(node_id, round)
            if world.complete or world.rejoin or self.job.ended.is_set():
                return world
            return None

        return LongPoll(
            self.job.rounds,
            check,
            lambda: self.comm_world_now(node_id, round),
            self.job.close_deadline,
        )

    def comm_world_now(self, node_id: str, round: int) -> api.CommWorld:
        """`get_comm_world` without waiting."""
        with _refusals():
            world = self.job.get_world(node_id, 0)
        if world is None:
            with _refusals():
                rejoin = round > 0 and self.job.lost_join(node_id, round)
            return api.CommWorld(round=round, complete=False, rejoin=rejoin)
        me = world.member(node_id)
        assert me is not None
        return api.CommWorld(
            round=world.round,
            complete=True,
            num_nodes=len(world.members),
            node_rank=me.node_rank,
            world_size=world.world_size,
            rank_offset=world.rank_offset(me.node_rank),
            store_host=world.store_host,
            store_port=world.store_port,
        )

    def num_nodes_waiting(self, node_id: str, round: int, wait_s: float = 0.0) -> api.Waiting:
        """Waiting nodes that should make the running world re-form now, and the newest round; also
        a sign of life of the node. ``wait_s``: see `membership_poll`."""
        return self._hold(self.membership_poll(node_id, round), wait_s)

    def membership_poll(self, node_id: str, round: int) -> LongPoll[api.Waiting]:
        """The membership watch of a running node: it ends as soon as its world must re-form or
        the job ended."""

        def check() -> api.Waiting | None:
            w = self.waiting_now(node_id, round)
            return w if w.waiting > 0 or w.latest_round > round or w.job_ended else None

        return LongPoll(self.job.membership, check, lambda: self.waiting_now(node_id, round))

    def waiting_now(self, node_id: str, round: int) -> api.Waiting:
        """`num_nodes_waiting` without waiting."""
        with _refusals():
            waiting, latest = self.job.num_nodes_waiting(node_id, round)
        return api.Waiting(waiting, latest, self.job.ended.is_set())

    def report_node_status(self, report: api.NodeReport, wait_s: float = 0.0) -> bool:
        """Record how the node's workers finished; True once every member of the last world has
        succeeded. A failure fails the job. ``wait_s``: see `exit_poll`."""
        return self._hold(self.exit_poll(report), wait_s)

    def exit_poll(self, report: api.NodeReport) -> LongPoll[bool]:
        """Record the report now (idempotent), then wait for the job's end: the exit barrier."""
        done = self.report_now(report)

        def check() -> bool | None:
            return self.job.state == JobState.SUCCEEDED if self.job.ended.is_set() else None

        return LongPoll(self.job.rounds, lambda: True if done else check(), lambda: False)

    def report_now(self, report: api.NodeReport) -> bool:
        """`report_node_status` without waiting."""
        with _refusals():
            return self.job.report_node_status(
                report.node_id,
                report.incarnation,
                report.outcome.value,
                report.exit_code,
                report.reason,
            )

    def join_node_check(self, join: api.NodeCheckJoin, wait_s: float = 0.0) -> api.NodeCheckTask:
        """Record the node ready for the check round; its task once every member joined the
        round or the verdict is out. ``wait_s``: see `node_check_poll`."""
        return self._hold(self.node_check_poll(join), wait_s)

    def node_check_poll(self, join: api.NodeCheckJoin) -> LongPoll[api.NodeCheckTask]:
        """Record the join now (raises for an unknown node or a stale incarnation), then wait for
        the node's task: RUN once the round is paired, DONE / REFORM once decided."""
        with _refusals():
            self.job.join_node_check(join)

        def task() -> api.NodeCheckTask | None:
            return self.job.node_check_task(join.node_id, join.rdzv_round, join.check_round)

        return LongPoll(
            self.job.checks,
            task,
            lambda: task() or api.NodeCheckTask(api.NodeCheckState.WAIT, join.check_round),
            self.job.node_check_deadline,
        )

    def report_node_check(self, report: api.NodeCheckReport) -> None:
        """Record the node's result of a check round."""
        with _refusals():
            self.job.report_node_check(report)

    def report_failure(self, node_id: str, incarnation: int, record: api.FailureRecord) -> None:
        """Record a classified failure of the node's workers (raises for an unknown node or a
        stale incarnation)."""
        with _refusals():
            self.job.nodes.get(node_id, incarnation)
            self.job.record_failure(record)

    def get_failures(self) -> tuple[api.FailureRecord, ...]:
        """Every failure the job recorded, oldest first."""
        return self.job.failures()

    def get_job_status(self, with_nodes: bool = True) -> api.JobStatus:
        """The job and (``with_nodes``) every node now; heartbeat ages come from the master's
        clock."""
        job = self.job
        now = job.now()
        scores = job.straggler_scores()
        rates = job.rates()
        return api.JobStatus(
            job_name=job.config.job_name,
            state=job.state.value,
            round=job.rendezvous.round if job.rendezvous else 0,
            reason=job.reason,
            exit_code=job.exit_code,
            nodes=tuple(
                api.NodeStatus(
                    node_id=n.node_id,
                    state=n.state.value,
                    node_rank=n.node_rank,
                    host=n.host,
                    step=n.step,
                    restart_count=n.restart_count,
                    last_heartbeat_age_s=max(0.0, now - n.last_heartbeat),
                    role=n.role,
                    cpu_percent=n.cpu_percent,
                    memory_bytes=n.memory_bytes,
                    check=job.check_words.get(n.node_id, ""),
                    score=scores[n.node_id].relative if n.node_id in scores else 0.0,
                    step_wall_s=n.breakdown[0],
                    step_data_s=n.breakdown[1],
                    step_checkpoint_s=n.breakdown[2],
                    pid=n.pid,
                    worker_pids=n.worker_pids,
                )
                for n in (job.nodes.all() if with_nodes else ())
            )
            + tuple(
                api.NodeStatus(
                    node_id=r.node_id,
                    state=r.state,
                    node_rank=r.index,
                    host="",
                    step=-1,
                    restart_count=r.relaunches,
                    last_heartbeat_age_s=0.0,
                    role=r.role,
                    cpu_percent=r.cpu_percent,
                    memory_bytes=r.memory_bytes,
                    pid=r.pid,
                    memory_limit_bytes=r.memory_limit_bytes,
                )
                for r in (job.role_nodes() if with_nodes else ())
            ),
            node_check=job.check_summary,
            autoscale=job.scale_summary,
            goodput=job.goodput.snapshot(now).ratio,
            metrics_port=job.metrics_port,
            embedding_servers=tuple(
                api.EmbeddingServerStatus(s.index, s.address, s.rows, s.bytes, s.lookups_per_s)
                for s in (job.ps.stats() if job.ps is not None else ())
            ),
            steps_per_s=rates.steps_per_s,
            samples_per_s=rates.samples_per_s,
        )

    def stop_job(self, reason: str) -> api.JobStatus:
        """Fail the job with ``reason`` ("stopped by request" if empty) and return its status."""
        self.job.stop(reason or "stopped by request")
        return self.get_job_status()

    def scale_role(self, role: str, count: int) -> tuple[str, int]:
        """Ask for ``count`` nodes of ``role``: what will happen, and the request's id
        (refusals raise MasterRequestError)."""
        with _refusals():
            return self.job.scale_role(role, count)

    def kv_set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``; the key-value store's limits raise MasterRequestError."""
        with _refusals():
            self.job.kv.set(key, value)

    def kv_get(self, key: str, wait_s: float = 0.0) -> bytes | None:
        """The value of ``key``, waiting at most min(``wait_s``, MAX_KV_WAIT_S) in this one call;
        None if it did not appear."""
        with _refusals():
            return self.job.kv.get(key, wait_s)

    def report_step(
        self,
        step: int,
        rank: int | None = None,
        metrics: dict[str, float] | None = None,
        node_id: str | None = None,
    ) -> None:
        """Record the node's step. ``node_id`` is required here (None or "" raises
        UnknownNodeError); ``rank`` and ``metrics`` are ignored."""
        with _refusals():
            self.job.report_step(node_id or "", step)

    def checkpoint_persisted(self, step: int, node_rank: int, total_nodes: int) -> bool:
        """Record this node's report of ``step``; True for the step's one committer."""
        with _refusals():
            return self.job.checkpoint.report_persisted(step, node_rank, total_nodes)

    def checkpoint_committed(self, step: int) -> None:
        """Mark ``step`` committed (persisted in the state store) and wake its waiters."""
        self.job.checkpoint.mark_committed(step)

    def wait_checkpoint_committed(self, step: int, wait_s: float) -> bool:
        """Whether ``step`` or a newer one is committed within ``wait_s`` seconds (not capped here,
        unlike the gRPC servicer)."""
        return self.job.checkpoint.wait_committed(step, wait_s)

    def vote_load_step(
        self, node_rank: int, total_nodes: int, local_step: int | None, round_id: int, wait_s: float
    ) -> tuple[bool, int | None]:
        """Cast the vote and wait up to ``wait_s`` seconds for the round's decision: ``(decided,
        step)``."""
        return self.job.checkpoint.vote_load_step(
            node_rank, total_nodes, local_step, round_id, wait_s
        )
