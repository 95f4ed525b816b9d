"""The agent's conversation with the master about membership: register, join a round, notice
that the world must re-form, report the end and wait at the exit barrier."""

from __future__ import annotations

import functools
import logging
import os
import random
import threading
import time
from dataclasses import dataclass

from dlrover.agent.config import AgentConfig
from dlrover.api.errors import MasterClientError, MasterUnreachableError
from dlrover.api.master import (
    CommWorld,
    JoinRequest,
    MasterApi,
    NodeLimits,
    NodeOutcome,
    NodeReport,
    Registered,
    Registration,
)
from dlrover.api.retry import while_unreachable
from dlrover.backoff import Backoff
from dlrover.constants import DEFAULT_MASTER_RECONNECT_S, MAX_LONG_POLL_S

logger = logging.getLogger(__name__)


class AgentError(Exception):
    """The agent cannot go on (rendezvous timed out, the master refused the node...)."""


class RendezvousTimeoutError(AgentError):
    """Not enough nodes joined within the join timeout."""


@dataclass
class RunResult:
    """How the agent's run ended."""

    exit_code: int
    reason: str = ""


class MembershipWatch:
    """While this node's workers run, one long poll at a time asks the master whether the world
    must re-form (a node waits to join, a member left, a newer round closed) or the job ended.

    The master answers the moment that happens, and otherwise only every MAX_LONG_POLL_S: a
    running node costs the master one call per half minute instead of two per second, and
    learns of a change at once instead of at its next poll. An unreachable master is asked again
    with a back-off of up to 2 s.
    """

    def __init__(
        self, master: MasterApi, stop_requested: threading.Event, wait_s: float = MAX_LONG_POLL_S
    ) -> None:
        self._master = master
        self._stop_requested = stop_requested
        self._wait_s = wait_s
        self._cond = threading.Condition()
        self._armed: tuple[str, int] | None = None
        self._start_at = 0.0
        self._reform_round = -1
        self._rejoin_at: float | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def arm(self, node_id: str, round: int, after_s: float = 0.0) -> None:
        """Watch ``round`` of ``node_id`` (its workers now run in it), asking first ``after_s``
        from now (the round's nodes spread their watches: `CommWorld.spread_s`)."""
        with self._cond:
            self._armed = (node_id, round)
            self._start_at = time.monotonic() + after_s
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, daemon=True, name="dlrover-membership-watch"
                )
                self._thread.start()
            self._cond.notify_all()

    def disarm(self) -> None:
        """Stop watching (the node re-joins); a call in flight is ignored when it returns."""
        with self._cond:
            self._armed = None

    def must_reform(self, round: int) -> bool:
        """Whether the master said the world of ``round`` must re-form (no RPC)."""
        with self._cond:
            return self._reform_round == round

    def take_rejoin_at(self) -> float | None:
        """When (monotonic) to join again after the re-form the master told of, at a random
        point within its `Waiting.spread_s`; None when none was told since the last join."""
        with self._cond:
            at, self._rejoin_at = self._rejoin_at, None
            return at

    def close(self) -> None:
        """End the watch thread (it is a daemon: a call in flight does not hold up the exit)."""
        with self._cond:
            self._closed = True
            self._armed = None
            self._cond.notify_all()

    def _loop(self) -> None:
        backoff = Backoff(0.1, 2.0)
        while True:
            with self._cond:
                # Idle between rounds: look again every second (every wait has a deadline).
                self._cond.wait_for(lambda: self._closed or self._armed is not None, 1.0)
                if self._closed:
                    return
                if self._armed is None:
                    continue
                watched = self._armed
                delay = self._start_at - time.monotonic()
                if delay > 0:  # spread over the round's nodes; disarming ends the wait
                    self._cond.wait(min(delay, 1.0))
                    continue
            node_id, round = watched
            try:
                w = self._master.num_nodes_waiting(node_id, round, self._wait_s)
            except MasterClientError as e:
                pause = backoff.next()
                logger.debug("membership watch: %s; asking again in %.1fs", e, pause)
                with self._cond:
                    self._cond.wait(pause)
                continue
            backoff.reset()
            with self._cond:
                if self._armed != watched:
                    continue  # the node moved on while the call was held
                if w.job_ended:
                    self._armed = None
                    self._stop_requested.set()
                elif w.waiting > 0 or w.latest_round > round:
                    self._armed = None
                    self._reform_round = round
                    self._rejoin_at = time.monotonic() + random.uniform(0.0, w.spread_s)


class RendezvousClient:
    """Membership calls of one node; every wait has the config's deadline.

    `stop_requested` (set by the heartbeat when the master ends the job) cuts a wait short.
    Waits are long polls: the master answers when the round closes or the job ends, so a
    thousand waiting nodes cost it a thousand held calls, not ten thousand polls a second.
    """

    def __init__(
        self, master: MasterApi, config: AgentConfig, stop_requested: threading.Event
    ) -> None:
        self._master = master
        self._config = config
        self._stop_requested = stop_requested
        self._watch = MembershipWatch(master, stop_requested)
        self.node_id = ""
        self.incarnation = 0
        self.round = 0

    def close(self) -> None:
        """Stop the membership watch."""
        self._watch.close()

    def register(self, node_id: str, host: str, job_name: str) -> Registered:
        """Announce this node (again, with its old id after a restart or a loss)."""
        cfg = self._config
        registration = Registration(
            host=host,
            local_world_size=cfg.nproc_per_node,
            node_id=node_id,
            role=cfg.role,
            requested_rank=cfg.requested_node_rank,
            pid=os.getpid(),
            limits=NodeLimits(cfg.min_nodes, cfg.max_nodes, cfg.node_unit, cfg.last_call_timeout_s),
            job_name=job_name,
        )
        registered = while_unreachable(
            lambda: self._master.register_node(registration), self._reconnect_deadline(), "register"
        )
        self.node_id, self.incarnation = registered.node_id, registered.incarnation
        logger.info("registered as node %s (incarnation %d)", self.node_id, self.incarnation)
        return registered

    def join(self, store_host: str, store_port: int, local_world_size: int = 0) -> CommWorld:
        """Join the next round and wait until the master completes it; ``local_world_size``:
        the workers this node brings (default: --nproc-per-node)."""
        cfg = self._config
        start = time.monotonic()
        deadline = start + cfg.join_timeout_s
        request = JoinRequest(
            node_id=self.node_id,
            incarnation=self.incarnation,
            local_world_size=local_world_size or cfg.nproc_per_node,
            store_host=store_host,
            store_port=store_port,
        )
        self._watch.disarm()
        rejoin_at = self._watch.take_rejoin_at()
        if rejoin_at is not None and rejoin_at > time.monotonic():
            # The world re-forms: a large job's survivors spread their joins (its workers were
            # being stopped meanwhile); the master's end of the job cuts the wait short.
            self._stop_requested.wait(rejoin_at - time.monotonic())
        self.round = while_unreachable(
            lambda: self._master.join_rendezvous(request), deadline, "join the rendezvous"
        )
        next_log = start + 10.0
        backoff = Backoff(0.01, 0.5)
        spare = False
        while True:
            asked = time.monotonic()
            wait_s = min(MAX_LONG_POLL_S, max(0.0, deadline - asked))
            world = while_unreachable(
                functools.partial(self._master.get_comm_world, self.node_id, self.round, wait_s),
                deadline,
                "wait for the rendezvous",
            )
            if world.rejoin:
                logger.warning(
                    "the master does not know this node waits for round %d (it restarted); "
                    "joining again",
                    self.round,
                )
                self.round = while_unreachable(
                    lambda: self._master.join_rendezvous(request), deadline, "join the rendezvous"
                )
                continue
            if world.complete:
                self.round = world.round
                self._watch.arm(self.node_id, world.round, random.uniform(0.0, world.spread_s))
                logger.info(
                    "round %d: node rank %d of %d nodes, world size %d (%.2fs)",
                    world.round,
                    world.node_rank,
                    world.num_nodes,
                    world.world_size,
                    time.monotonic() - start,
                )
                return world
            now = time.monotonic()
            if self._stop_requested.is_set():
                raise AgentError("the master ended the job while this node waited to join")
            if world.spare:
                # A hot spare: the job runs at max nodes without it; it waits, its zygote
                # warm, for as long as the job runs, and takes the next lost node's place.
                if not spare:
                    logger.info(
                        "this node is a hot spare: it takes the place of the next node lost"
                    )
                    spare = True
                deadline = now + cfg.join_timeout_s
            if now >= deadline:
                raise RendezvousTimeoutError(
                    f"rendezvous round {self.round} did not complete within "
                    f"{cfg.join_timeout_s:.0f}s: the job needs at least {cfg.min_nodes} nodes; "
                    "start the missing nodes or lower --nnodes MIN (join_timeout in --rdzv-conf "
                    "sets this deadline)"
                )
            if now >= next_log and not spare:
                logger.info(
                    "waiting for nodes to join round %d (need %d)", self.round, cfg.min_nodes
                )
                next_log = now + 10.0
            if now - asked < 0.5:
                # The master answered without holding the call (a master without long polls):
                # do not turn the wait into a busy loop.
                time.sleep(backoff.next())

    def _reconnect_deadline(self) -> float:
        return time.monotonic() + DEFAULT_MASTER_RECONNECT_S

    def world_must_reform(self) -> bool:
        """A node waits to join, a member left, or a newer round completed without us, as the
        membership watch last heard from the master (no RPC here)."""
        return self._watch.must_reform(self.round)

    def report(self, outcome: NodeOutcome, exit_code: int, reason: str) -> bool:
        """Tell the master how this node's workers ended; True once the whole job succeeded.
        A master that stays unreachable or refuses is logged, and False returned."""
        try:
            return while_unreachable(
                lambda: self._master.report_node_status(
                    NodeReport(self.node_id, self.incarnation, outcome, exit_code, reason)
                ),
                self._reconnect_deadline(),
                f"report {outcome.value}",
            )
        except MasterClientError as e:
            logger.warning("could not report %s to the master: %s", outcome.value, e)
            return False

    def exit_barrier(self) -> RunResult:
        """Report success, then wait (bounded) until every node of the world has finished.

        The report is repeated while waiting (it is idempotent): a master that died and came
        back on its saved state learns it even if the first report was lost with it.
        """
        cfg = self._config
        logger.info("all %d workers succeeded; waiting for the other nodes", cfg.nproc_per_node)
        self._watch.disarm()
        deadline = time.monotonic() + cfg.exit_barrier_timeout_s
        report = NodeReport(self.node_id, self.incarnation, NodeOutcome.SUCCEEDED, 0, "")
        backoff = Backoff(0.01, 0.5)
        while True:
            asked = time.monotonic()
            try:
                # A long poll: the master holds it until the job ends (or MAX_LONG_POLL_S).
                wait_s = min(MAX_LONG_POLL_S, max(0.0, deadline - time.monotonic()))
                if self._master.report_node_status(report, wait_s):
                    return RunResult(0, "succeeded")
                status = self._master.get_job_status(with_nodes=False)
                if status.state == "failed":
                    return RunResult(status.exit_code or 1, status.reason)
                if status.state == "succeeded":
                    return RunResult(0, "succeeded")
            except MasterUnreachableError as e:
                logger.warning("exit barrier: the master does not answer (%s); trying again", e)
            except MasterClientError as e:
                logger.warning("exit barrier: the master refused the report (%s)", e)
                return RunResult(0, "succeeded")
            if time.monotonic() >= deadline:
                logger.warning(
                    "exit barrier: other nodes did not finish within %.0fs; exiting anyway",
                    cfg.exit_barrier_timeout_s,
                )
                return RunResult(0, "succeeded")
            if time.monotonic() - asked < 0.5:
                # Not held (an unreachable master, or one without long polls): back off.
                time.sleep(backoff.next())

    def ended_by_master(self) -> RunResult:
        """The master ended the job: this node exits with the job's outcome."""
        status = while_unreachable(
            lambda: self._master.get_job_status(with_nodes=False),
            self._reconnect_deadline(),
            "read the job's end",
        )
        code = 0 if status.state == "succeeded" else (status.exit_code or 1)
        return RunResult(code, f"the master ended the job: {status.reason}")
