"""The elastic agent of one node: rendezvous, start workers, watch them, restart, finish.

The parts: `rendezvous_client` (membership calls and the exit barrier), `launch_plan` (what to
start, pure), `monitor` (watching an attempt, ending in an `Outcome`), `failures` (what a
failure means), `heartbeat`, `zygote` (fast restarts). This module sequences them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import sys
import time
from typing import Any, Protocol

from dlrover import worker_context
from dlrover.agent.cgroup import oom_kill_count
from dlrover.agent.compile_cache import CacheSync, local_cache_folder
from dlrover.agent.compiler_warmup import compiler_in_use_marker
from dlrover.agent.config import AgentConfig
from dlrover.agent.failure_policy import (
    LEGAL_GROUP_TRANSITIONS,
    IllegalTransitionError,
    UserErrorSignature,
    WorkerGroupState,
)
from dlrover.agent.failures import Judgement, judge
from dlrover.agent.heartbeat import Heartbeat
from dlrover.agent.launch_plan import (
    CACHE_ON_MASTER,
    AttemptContext,
    LaunchPlan,
    compile_cache_env,
    plan_launch,
)
from dlrover.agent.monitor import MonitorSignals, Outcome, WorkerMonitor, describe_exit
from dlrover.agent.node_check import EXIT_EXCLUDED, CheckOutcome, CheckSettings, NodeChecker
from dlrover.agent.recovery_hub import RecoveryHub
from dlrover.agent.rendezvous_client import (
    AgentError,
    RendezvousClient,
    RendezvousTimeoutError,
    RunResult,
)
from dlrover.agent.workers import WorkerGroup
from dlrover.agent.zygote import PendingZygote, Zygote, ZygoteError
from dlrover.api.master import (
    CommWorld,
    FailureClass,
    FailureRecord,
    HeartbeatReport,
    MasterApi,
    NodeOutcome,
)
from dlrover.checkpoint.config import CheckpointEnv
from dlrover.checkpoint.leftovers import OwnerLock, owner_prefix, runtime_dir, sweep
from dlrover.client.checkpoint import MasterCommitCoordinator, MasterPeerDirectory
from dlrover.constants import (
    DEFAULT_JOB_NAME,
    DEFAULT_ZYGOTE_FIRST_WAIT_S,
    ENV_NODE_MEMORY_LIMIT_MIB,
    ENV_NODE_NAME,
    ENV_RECOVERY_JOIN,
    ENV_ZYGOTE_WARM_COMPILER,
    EXIT_MASTER_LOST,
    EXIT_NODE_OOM,
)
from dlrover.coordination import HANG_HISTORY
from dlrover.decisions import NO_ACTION, FailureAction
from dlrover.faults import ENV_FAULTS, node_slot, pending_until
from dlrover.hang_spec import PhaseHistory
from dlrover.processes import UsageMeter
from dlrover.recovery_channel import env_changes

BOOTSTRAP_MODULE = "dlrover.agent.bootstrap"


def _has_entries(folder: str) -> bool:
    try:
        with os.scandir(folder) as entries:
            return any(True for _ in entries)
    except OSError:
        return False


HANG_HISTORY_SAVE_S = 30.0
"""How often (at most) an agent saves its phase durations through the master."""
"""The module every worker runs its target through (``python -u -m`` it, then the target)."""

logger = logging.getLogger(__name__)

__all__ = [
    "AgentError",
    "ElasticAgent",
    "RendezvousTimeoutError",
    "RunResult",
    "SignalReceived",
    "describe_exit",
    "free_port",
    "install_signal_handlers",
]


class SignalReceived(Exception):
    """SIGTERM/SIGINT reached the agent: workers are stopped, the agent exits."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


def free_port() -> int:
    """A port for the rank-0 worker's store, kept from everyone else on this machine meanwhile.

    A port merely free a moment ago was taken in between on a busy machine (the worker's TCPStore
    failed with EADDRINUSE and the node spent a restart on it). So the port is left in TIME_WAIT:
    a connection to it is accepted and closed by its listening side first. For a minute the
    kernel gives it to no ``bind(port 0)`` and no outgoing connection, while a listener that sets
    SO_REUSEADDR, as the TCPStore does (c10d's and libuv's both), binds it at once."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("", 0))
            server.listen(1)
            port = int(server.getsockname()[1])
            with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
                accepted, _ = server.accept()
                accepted.close()  # this side first: the TIME_WAIT is on ``port``
                client.recv(1)  # its end seen: the close is under way before ours
            return port
    except OSError:  # no loopback to connect through: a port free a moment ago
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return int(s.getsockname()[1])


class WorkerFaults(Protocol):
    """Faults the agent applies to its own workers (`dlrover.faults.throttle.SlowFaults`: the
    ``slow`` fault of DLROVER_FAULTS, which `dlrover-run` hands the agent)."""

    def clean_leftovers(self) -> None:
        """Undo what agents SIGKILLed on this machine left applied (as this agent starts)."""

    def start_attempt(
        self,
        rank_offset: int,
        pids: dict[int, int],
        restart_count: int,
        node: tuple[int, int] | None,
    ) -> None:
        """An attempt's workers (local rank -> pid) run."""

    def tick(self, step: int) -> None:
        """About every second, with the node's newest step."""

    def release(self) -> None:
        """Before the workers are stopped or judged: nothing applied any more."""


class ElasticAgent:
    """Runs the workers of one node for the life of the job.

    `run()` calls `start()` (register, saver, heartbeat), then `step()` until it returns a result. One step: join a
    rendezvous round -> start `nproc_per_node` workers with torchrun's env -> watch them until
    an `Outcome` -> act on it. A failed worker restarts the whole local group after a new round
    (bounded by max_restarts); a membership change (a node waits to join, or a known node came
    back) re-forms without using up a restart; success ends in an exit barrier.

    `master` is any `MasterApi`: a `MasterClient` (gRPC) or, in tests, a `LocalMasterApi`;
    `worker_faults`, fault injection applied to the workers (None: none).
    """

    def __init__(
        self,
        config: AgentConfig,
        master: MasterApi,
        master_addr: str,
        token: str,
        worker_faults: WorkerFaults | None = None,
    ):
        self.config = config
        self.master = master
        self._master_addr = master_addr
        self._token = token
        # An engine names the node it launched; otherwise the master picks an id.
        self._node_name = os.environ.get(ENV_NODE_NAME, "")
        self.run_id = config.run_id
        """TORCHELASTIC_RUN_ID: --rdzv-id, or without one the job name the master reports."""
        self.restart_count = 0
        self.state = WorkerGroupState.INIT
        self.step_reached = -1
        """The newest training step any worker of this node reported."""
        self._fast_restart = config.fast_restart
        self._attempt = 0
        self._group: WorkerGroup | None = None
        self._monitor: WorkerMonitor | None = None
        self._plan: LaunchPlan | None = None
        self._heartbeat = Heartbeat(
            master,
            config.heartbeat_interval_s,
            self._heartbeat_report,
            lost_timeout_s=config.master_lost_timeout_s,
        )
        self._rdzv = RendezvousClient(master, config, self._heartbeat.stop_requested)
        self._host = config.local_addr or self._guess_host()
        self._run_dir = ""
        self._owner_lock: OwnerLock | None = None
        self._history: list[UserErrorSignature | None] = []
        self._hang_history = PhaseHistory()
        """The phase durations hang timeouts are learned from (this node's and, from the
        start, the job's as saved through the master)."""
        self._hang_history_saved = (0.0, b"")
        self._zygote: PendingZygote | None = None
        self._zygote_warm_asked = False
        self._warm_compiler = os.environ.get(ENV_ZYGOTE_WARM_COMPILER, "1") != "0"
        self._job_compiles = False
        """Whether this node's workers (or, by its compile cache, the job's nodes) compile: the
        zygote then warms the compiler (`dlrover.agent.compiler_warmup`)."""
        self._saver: Any = None
        self._hub: RecoveryHub | None = None
        self._cache_sync: CacheSync | None = None
        self._keep: set[int] | None = None
        """Local ranks of workers parked in-process, to be handed the next round (None: the
        next round starts every worker)."""
        self._joiners: dict[int, int] = {}
        """Local rank -> pid of replacements started to join a round once they are ready."""
        self._growth_off = False
        """The round's workers are finishing: replacements waiting to join are not taken in."""
        self._worker_env: dict[int, dict[str, str]] = {}
        """Local rank -> the environment its running process has (a round changes it)."""
        self.in_process_recoveries = 0
        """Rounds this node's workers joined in their own processes."""
        self._started_at = time.monotonic()
        self._usage = UsageMeter()
        self._oom_kills: int | None = None
        """The cgroup's OOM-kill counter when the current workers started."""
        self._faults = worker_faults
        self._checker = (
            NodeChecker(
                master,
                self._host,
                CheckSettings(config.straggler_ratio, config.exclude_straggler),
                lambda: (self.node_id, self.incarnation),
                free_port,
                config.requested_node_rank,
            )
            if config.node_check
            else None
        )

    @property
    def node_id(self) -> str:
        """This node's id: the one the master gave at registration; before that the engine's node
        name, or ""."""
        return self._rdzv.node_id or self._node_name

    @property
    def incarnation(self) -> int:
        """The incarnation of the last registration (0 before it); the master refuses calls of an
        older one."""
        return self._rdzv.incarnation

    def _guess_host(self) -> str:
        host = self._master_addr.rsplit(":", 1)[0].strip("[]")
        if host in ("127.0.0.1", "localhost", "::1"):
            return "127.0.0.1"
        return socket.getfqdn()

    def _set_state(self, new: WorkerGroupState) -> None:
        if new not in LEGAL_GROUP_TRANSITIONS[self.state]:
            raise IllegalTransitionError(f"worker group: {self.state.value} -> {new.value}")
        self.state = new

    # --- lifecycle -------------------------------------------------------------------------------
    def run(self) -> RunResult:
        """Start, then step until the job ends for this node; always stops the workers."""
        self.start()
        try:
            while True:
                result = self.step()
                if result is not None:
                    return result
        finally:
            self.close()

    def start(self) -> None:
        """Register with the master, host the checkpoint saver, start heartbeats."""
        if self._checker is not None:
            self._checker.prepare()  # its torch import overlaps registration and rendezvous
        try:
            settings = CheckpointEnv.from_env()
        except ValueError as e:
            raise AgentError(str(e)) from None
        # What agents SIGKILLed on this node left behind (their owner lock is free); live
        # agents' things, of this job or another, are not touched.
        sweep(settings.shm_dir, spill_dir=settings.spill_dir)
        if self._faults is not None:
            self._faults.clean_leftovers()
        self._wait_pending()
        self._register()
        self._load_hang_history()
        # Named for the job, node and this process, and guarded by a lock held until close:
        # an operator can tell whose they are, and the next agent's sweep whether the owner died.
        prefix = owner_prefix(self.run_id, self.node_id or "node", os.getpid())
        self._owner_lock = OwnerLock(prefix, settings.shm_dir)
        self._run_dir = os.path.join(runtime_dir(), f"{prefix}.agent")
        os.makedirs(self._run_dir, mode=0o700, exist_ok=True)
        self._start_saver(f"{prefix}.ckpt", settings)
        self._hub = RecoveryHub(os.path.join(self._run_dir, "recovery.sock"))
        self._heartbeat.start()
        cache_folder = self.config.compile_cache
        if cache_folder == CACHE_ON_MASTER:
            # This machine's folder, filled with what the job's nodes compiled so far.
            self._cache_sync = CacheSync(self.master, local_cache_folder(self.run_id))
            self._cache_sync.pull()
            cache_folder = self._cache_sync.folder
            mine = [
                n for n in compile_cache_env(cache_folder) if n.endswith("_DIR") and n in os.environ
            ]
            if mine:
                logger.warning(
                    "--compile-cache master: %s set by the job keeps those caches out of the "
                    "job's share (only %s is shared); unset it to share them",
                    " and ".join(mine),
                    cache_folder,
                )
        if cache_folder:
            # Before the zygote starts: torch reads some of them as it is imported.
            for name, value in compile_cache_env(cache_folder).items():
                os.environ.setdefault(name, value)
            # Graphs in the job's cache: its nodes compile, so the zygote warms the compiler
            # before this node's first workers fork (they skip that work too).
            self._job_compiles = _has_entries(os.environ["TORCHINDUCTOR_CACHE_DIR"])
        self._begin_zygote_now()
        if self._cache_sync is not None:
            self._cache_sync.start()  # what this node's workers compile goes to the master

    def _judge(
        self, monitor: WorkerMonitor, exits: dict[int, int], oom_killed: bool = False
    ) -> Judgement:
        """The failure policy's verdict on ``exits`` of the current attempt."""
        assert self._plan is not None
        return judge(
            exits,
            self._plan.error_files,
            monitor.hung,
            self.restart_count,
            self.config.max_restarts,
            self._history,
            self.node_id,
            oom_killed=oom_killed,
            hang_reasons=monitor.hang_reasons,
        )

    def _wait_pending(self, deadline_s: float = 300.0) -> None:
        """DLROVER_FAULTS's ``pending``: a replacement node waits, unregistered, until its file
        exists (a pod pending for room), at most ``deadline_s``."""
        path = pending_until(os.environ.get(ENV_FAULTS, ""), node_slot(self._node_name))
        if not path:
            return
        logger.warning("fault injection: node %s pending until %s exists", self._node_name, path)
        end = time.monotonic() + deadline_s
        while not os.path.exists(path) and time.monotonic() < end:
            time.sleep(0.1)

    def close(self) -> None:
        """Stop the workers, the heartbeat, the zygote and the saver; remove the run dir."""
        if not self._heartbeat.master_lost.is_set():
            self._save_hang_history(every_s=0.0)  # what this node learned, for its successor
        if self._faults is not None:
            self._faults.release()
        if self._group is not None:
            self._group.stop(self.config.stop_grace_s)
        if self._hub is not None:
            self._hub.close()
            self._hub = None
        if self._cache_sync is not None:
            if not self._heartbeat.master_lost.is_set():
                self._cache_sync.close()  # what the workers compiled last, for the job
            self._cache_sync = None
        self._heartbeat.stop()
        self._rdzv.close()
        if self._checker is not None:
            self._checker.close()
        if self._zygote is not None:
            self._zygote.cancel()
            self._zygote = None
        if self._saver is not None:
            # Persists already queued (the last checkpoint) finish before the memory goes.
            self._saver.close(unlink=True, timeout=self.config.checkpoint_close_timeout_s)
            self._saver = None
        if self._run_dir:
            shutil.rmtree(self._run_dir, ignore_errors=True)
        if self._owner_lock is not None:
            self._owner_lock.release()  # last: until now a sweep sees the owner alive
            self._owner_lock = None

    def step(self) -> RunResult | None:
        """One round: rendezvous, start the workers, watch them, act on the outcome. Returns
        the node's result when the job ends for it, None to go on with another round."""
        self._set_state(WorkerGroupState.RENDEZVOUS)
        keep = self._keep
        members = self._next_members(keep) if keep is not None else None
        world = self._rdzv.join(
            self.config.store_addr or self._host,
            self.config.store_port or free_port(),
            len(members) if members is not None else 0,
        )
        if self._checker is not None and keep is None:
            checked, why = self._checker.check(world)
            if checked is CheckOutcome.REFORM:
                return None
            if checked is CheckOutcome.EXCLUDED:
                logger.error("the node check excluded this node: %s", why)
                self._set_state(WorkerGroupState.FAILED)
                return RunResult(EXIT_EXCLUDED, f"excluded by the node check: {why}")
        if self._saver is not None:  # the node's load vote; replicas: peers find it
            self._saver.prepare_round(
                world.round,
                world.node_rank,
                world.num_nodes,
                len(members) if members is not None else self.config.nproc_per_node,
                world_size=world.world_size,
                rank_offset=world.rank_offset,
            )
        if keep is not None:
            monitor = self._reform_in_process(world, keep, members)
        else:
            monitor = self._start_workers(world)
        self._set_state(WorkerGroupState.RUNNING)
        outcome = monitor.wait()
        while self._in_round(outcome, monitor):
            outcome = monitor.wait()
        self.step_reached = max(self.step_reached, monitor.step)
        return self._act_on(outcome, monitor)

    def _act_on(self, outcome: Outcome, monitor: WorkerMonitor) -> RunResult | None:
        cfg = self.config
        group = self._group
        assert group is not None
        if self._faults is not None:
            self._faults.release()  # a stopped worker would not see the agent's SIGTERM
        if outcome in (Outcome.SUCCEEDED, Outcome.FAILED):
            # The steps since the last beat, before the workers' state changes (goodput).
            monitor.check_progress()
            self._heartbeat.beat()
        if outcome is Outcome.SUCCEEDED:
            if self._joiners:  # the job ended before they were needed
                group.kill_ranks(list(self._joiners))
                self._joiners.clear()
            group.close()
            self._set_state(WorkerGroupState.SUCCEEDED)
            return self._rdzv.exit_barrier()
        if outcome is Outcome.STOP:
            group.stop(cfg.stop_grace_s)
            self._set_state(WorkerGroupState.STOPPED)
            return self._rdzv.ended_by_master()
        if outcome is Outcome.REREGISTER:
            # The master took this node for lost (or restarted without it): join afresh.
            logger.warning("the master lost track of this node; registering again")
            group.stop(cfg.stop_grace_s)
            self._set_state(WorkerGroupState.RESTARTING)
            self._heartbeat.reregister_requested.clear()
            self._register()
            return None
        if outcome is Outcome.MASTER_LOST:
            # Nobody is left to end the job, re-form it or hand out data: training on would
            # leave these workers running for ever. Keep the newest memory step on storage.
            group.stop(cfg.stop_grace_s)
            self._persist_on_failure()
            self._set_state(WorkerGroupState.FAILED)
            why = (
                f"the job's master at {self._master_addr} answered no heartbeat for "
                f"{cfg.master_lost_timeout_s:.0f}s (--master-lost-timeout): this node stopped "
                "its workers. Start the master again on its state (dlrover submit does it by "
                "itself), then this node"
            )
            logger.error(why)
            return RunResult(EXIT_MASTER_LOST, why)
        if outcome is Outcome.MEMBERSHIP and self._survivors_opted_in():
            logger.info(
                "membership changed: re-forming the world; the workers stay in their processes"
            )
            self._park(group.alive(), "the world re-forms: membership changed")
            return None
        if outcome is Outcome.PARKED:
            return self._on_unasked_park()
        if outcome is Outcome.JOINER_READY:
            ready = sorted(self._ready_joiners())
            self._park(self._members_alive(), f"local rank(s) {ready} rejoin", at_step_end=True)
            return None
        if (
            outcome is Outcome.FAILED
            and self._survivors_opted_in()
            and self._fail_in_process(monitor)
        ):
            return None
        if outcome is Outcome.MEMBERSHIP:
            logger.info("membership changed: re-forming the world (no restart used)")
            stopping_at = time.time()
            exits = monitor.stop_and_collect_failures()
            if self._plan is not None:
                # A user error raised as the world re-forms (a node lost at the same step)
                # still counts toward failing fast: else the same error is seen once more. A
                # rank whose error file predates the stop failed by itself, even if our SIGTERM
                # ended its teardown.
                for rank, path in self._plan.error_files.items():
                    if rank not in exits and _written_before(path, stopping_at):
                        exits[rank] = 1
            if exits and self._plan is not None:
                seen = self._judge(monitor, exits)
                previous = self._history[-1] if self._history else None
                if seen.signature is not None:
                    self._history.append(seen.signature)
                if seen.signature is not None and seen.signature == previous:
                    # The same user error as this node's last failed attempt: the job fails
                    # fast here, naming it, though other nodes' collateral errors (their
                    # peer, this node's worker, went away) re-formed the world first.
                    return self._fail_fast(seen)
                self._report_raised_before(monitor, exits, stopping_at)
            self._set_state(WorkerGroupState.RESTARTING)
            return None
        # A worker failed or hung: the policy decides between a restart and failing fast.
        exits = monitor.stop_and_collect_failures()
        assert self._plan is not None
        verdict = self._judge(monitor, exits, oom_killed=self._oom_kills_since_start())
        self._history.append(verdict.signature)
        limit_mib = os.environ.get(ENV_NODE_MEMORY_LIMIT_MIB, "")
        if verdict.failure_class is FailureClass.OOM and limit_mib.isdigit():
            # Under the node's own memory limit a restart in place would run out again: leave,
            # and the engine relaunches the node with more memory (EXIT_NODE_OOM).
            self._persist_on_failure()
            logger.error(
                "a worker was OOM-killed at this node's %s MiB memory limit; leaving so that the "
                "node is relaunched with more memory\n%s",
                limit_mib,
                verdict.report,
            )
            self._set_state(WorkerGroupState.FAILED)
            return RunResult(EXIT_NODE_OOM, f"OOM at the node's {limit_mib} MiB limit")
        self._report_failure(verdict)
        self._persist_on_failure()
        if verdict.decision.action is FailureAction.RESTART_PROCESSES:
            self.restart_count += 1
            self._set_state(WorkerGroupState.RESTARTING)
            logger.warning("restarting workers: %s\n%s", verdict.decision.reason, verdict.report)
            return None
        reason = verdict.decision.reason
        if verdict.decision.cannot_start:  # name what cannot start
            reason = f"`{self._program()}`: {reason}"
        logger.error("giving up: %s", reason)
        self._set_state(WorkerGroupState.FAILED)
        self._rdzv.report(NodeOutcome.FAILED, verdict.exit_code, reason)
        return RunResult(verdict.exit_code, f"{reason}\n{verdict.report}")

    def _fail_fast(self, verdict: Judgement) -> RunResult:
        """End this node (and so the job) on a user error seen twice in a row."""
        reason = verdict.decision.reason
        self._report_failure(verdict, FailureAction.FAIL)
        self._persist_on_failure()
        logger.error("giving up: %s\n%s", reason, verdict.report)
        self._set_state(WorkerGroupState.FAILED)
        self._rdzv.report(NodeOutcome.FAILED, verdict.exit_code, reason)
        return RunResult(verdict.exit_code, f"{reason}\n{verdict.report}")

    def _program(self) -> str:
        """The user's command the workers run (what follows the bootstrap in their argv)."""
        argv = list(self.config.entrypoint)
        if BOOTSTRAP_MODULE in argv:
            argv = argv[argv.index(BOOTSTRAP_MODULE) + 1 :]
        return shlex.join(argv)

    # --- in-process recovery ---------------------------------------------------------------------
    def _members_alive(self) -> list[int]:
        """Local ranks of the round's workers that still run (not replacements still joining)."""
        assert self._group is not None and self._plan is not None
        return [
            lr for lr in self._group.alive() if lr in self._plan.active and lr not in self._joiners
        ]

    def _survivors_opted_in(self) -> bool:
        """Whether every running worker of the round recovers in-process (said Hello)."""
        group = self._group
        if self._hub is None or group is None or self._plan is None:
            return False
        pids = group.pids
        alive = self._members_alive()
        return bool(alive) and self._hub.opted_in({lr: pids[lr] for lr in alive})

    def _ready_joiners(self) -> set[int]:
        """Replacements that said they are ready to join."""
        if self._hub is None or not self._joiners or self._growth_off:
            return set()
        hub = self._hub
        return {lr for lr, pid in self._joiners.items() if hub.opted_in({lr: pid})}

    def _start_joiners(self, local_ranks: list[int]) -> None:
        """Fork replacements of these local ranks now; each joins a round once it is ready."""
        group, plan = self._group, self._plan
        assert group is not None and plan is not None
        zygote = self._ready_zygote(self.config.zygote_wait_s)
        for lr in local_ranks:
            launch = plan.launches[lr]
            env = {
                **launch.env,
                ENV_RECOVERY_JOIN: "1",
                worker_context.RESTART_COUNT: str(self.restart_count),
            }
            launch = dataclasses.replace(launch, env=env)
            with contextlib.suppress(OSError):
                os.unlink(plan.files[lr].error_file)  # the predecessor's
            group.returncodes.pop(lr, None)
            if self._monitor is not None:
                self._monitor.forget(lr)
            group.start([launch], zygote)
            self._joiners[lr] = group.pids[lr]
            self._worker_env[lr] = dict(launch.env)
        logger.info("started replacement(s) of local rank(s) %s; they join once ready", local_ranks)

    def _in_round(self, outcome: Outcome, monitor: WorkerMonitor) -> bool:
        """Handle what needs no new round: a replacement ready for the round already formed
        for it, or a replacement that failed before it joined. True: keep watching."""
        plan = self._plan
        assert plan is not None and self._group is not None
        if outcome is Outcome.JOINER_READY:
            if not self._survivors_opted_in():
                # A worker of the round left its function (it finished): the job ends without
                # the replacements; they are stopped when the round's workers have exited.
                self._growth_off = True
                return True
            ready = self._ready_joiners()
            for lr in sorted(ready & plan.active):
                self._send_round(lr, plan)
                del self._joiners[lr]
            return not (ready - plan.active)
        if outcome is Outcome.FAILED and self._joiners:
            exits = monitor.collect_failures()
            failed = {lr for lr in range(len(plan.launches)) if plan.launches[lr].rank in exits}
            if not failed or not failed <= set(self._joiners):
                return False
            verdict = self._judge(monitor, exits)
            if verdict.decision.action is not FailureAction.RESTART_PROCESSES:
                return False
            self._history.append(verdict.signature)
            self.restart_count += 1
            self._report_failure(verdict, FailureAction.RECOVER_IN_PROCESS)
            logger.warning(
                "a replacement failed before it joined; starting another: %s", verdict.summary
            )
            for lr in failed:
                del self._joiners[lr]
            self._start_joiners(sorted(failed))
            return True
        return False

    def _send_round(self, local_rank: int, plan: LaunchPlan) -> None:
        """Hand a parked (or ready) worker the round of ``plan``: what changed in its env."""
        assert self._hub is not None and self._rdzv.round is not None
        after = plan.launches[local_rank].env
        changes = env_changes(self._worker_env.get(local_rank, {}), after)
        self._hub.send_round(local_rank, self._rdzv.round, changes)
        self._worker_env[local_rank] = dict(after)

    def _fail_in_process(self, monitor: WorkerMonitor) -> bool:
        """A worker failed and the others recover in-process: judge the failure once, keep the
        survivors' processes, replace only the failed. False: the usual restart decides (the
        policy gives up, or the node's memory limit was hit)."""
        plan = self._plan
        assert self._group is not None and plan is not None
        exits = monitor.collect_failures()
        verdict = self._judge(monitor, exits, oom_killed=self._oom_kills_since_start())
        node_limit = os.environ.get(ENV_NODE_MEMORY_LIMIT_MIB, "").isdigit()
        if verdict.decision.action is not FailureAction.RESTART_PROCESSES or (
            verdict.failure_class is FailureClass.OOM and node_limit
        ):
            return False
        self._history.append(verdict.signature)
        self.restart_count += 1
        self._report_failure(verdict, FailureAction.RECOVER_IN_PROCESS)
        failed = sorted(lr for lr in range(len(plan.launches)) if plan.launches[lr].rank in exits)
        logger.warning(
            "replacing failed rank(s) %s; the other workers stay in their processes: %s\n%s",
            ", ".join(str(r) for r in sorted(exits)),
            verdict.decision.reason,
            verdict.report,
        )
        survivors = self._members_alive()
        self._start_joiners([lr for lr in failed if lr not in self._group.alive()])
        self._park(survivors, f"rank(s) {sorted(exits)} failed: {verdict.summary}")
        return True

    def _on_unasked_park(self) -> RunResult | None:
        """Workers left their step by themselves (a collective failed, nothing in the job
        failed that the agent knows of, e.g. a collective timed out): a failure of this node."""
        assert self._hub is not None and self._group is not None
        parked = self._hub.parked_unasked()
        why = "; ".join(
            f"local rank {lr}: {err.splitlines()[0][:300]}" for lr, err in parked.items()
        )
        self.restart_count += 1
        record = FailureRecord(
            time.time(),
            self.node_id,
            FailureClass.HANG,
            FailureAction.RECOVER_IN_PROCESS.value,
            f"a collective failed with no failure in the job: {why}"[:4000],
            self.restart_count,
        )
        try:
            self.master.report_failure(self.node_id, self.incarnation, record)
        except Exception as e:  # the log has it
            logger.warning("could not report the failure to the master: %s", e)
        if self.restart_count > self.config.max_restarts or not self._survivors_opted_in():
            self._group.stop(self.config.stop_grace_s)
            self._joiners.clear()
            if self.restart_count > self.config.max_restarts:
                reason = f"{self.restart_count - 1} restarts used (--max-restarts); last: {why}"
                logger.error("giving up: %s", reason)
                self._set_state(WorkerGroupState.FAILED)
                self._rdzv.report(NodeOutcome.FAILED, 1, reason)
                return RunResult(1, reason)
            self._set_state(WorkerGroupState.RESTARTING)
            return None
        logger.warning("a collective failed with no failure in the job; re-forming: %s", why)
        self._park(self._members_alive(), "a collective failed: the world re-forms")
        return None

    def _park(self, survivors: list[int], reason: str, at_step_end: bool = False) -> None:
        """Ask the survivors to leave their step; keep those that park within the release
        timeout for the next round, restart the others."""
        assert self._hub is not None and self._group is not None
        started = time.monotonic()
        self._hub.abort(survivors, reason, at_step_end)
        parked = self._hub.wait_parked(survivors, self.config.release_timeout_s)
        stuck = [lr for lr in survivors if lr not in parked]
        if stuck:
            logger.warning(
                "local rank(s) %s did not leave their step within %.0fs (--release-timeout); "
                "replacing them",
                stuck,
                self.config.release_timeout_s,
            )
            self._group.kill_ranks(stuck)
        logger.info(
            "local rank(s) %s parked in %.3fs; re-forming the world",
            sorted(parked),
            time.monotonic() - started,
        )
        self._keep = parked
        self._set_state(WorkerGroupState.RESTARTING)

    def _next_members(self, keep: set[int]) -> set[int] | None:
        """The local ranks of the next round after a park: the kept workers and the ready
        replacements where the kept ones go on without the others; None: every local rank."""
        if keep and self._hub is not None and self._hub.shrink(keep):
            members = keep | self._ready_joiners()
            if len(members) < self.config.nproc_per_node:
                return members
        return None

    def _reform_in_process(
        self, world: CommWorld, keep: set[int], members: set[int] | None
    ) -> WorkerMonitor:
        """Hand the parked workers the new round; replace workers that are gone."""
        cfg = self.config
        group = self._group
        assert group is not None and self._hub is not None
        self._keep = None
        self._growth_off = False
        started = time.monotonic()
        plan = plan_launch(
            cfg, world, self._attempt_context(self._attempt - 1), os.environ, members
        )
        self._plan = plan
        alive = set(group.alive())
        gone = [lr for lr in range(cfg.nproc_per_node) if lr not in keep and lr not in alive]
        if gone:
            self._joiners = {lr: pid for lr, pid in self._joiners.items() if lr not in gone}
            self._start_joiners(gone)
        for lr in sorted(keep):
            self._send_round(lr, plan)
        for lr in sorted(self._ready_joiners() & plan.active):
            self._send_round(lr, plan)
            del self._joiners[lr]
        self.in_process_recoveries += 1
        waiting = sorted(self._joiners)
        logger.info(
            "round %d: %d worker(s) go on in their processes%s (%.3fs)",
            world.round,
            len(plan.active) - len([lr for lr in waiting if lr in plan.active]),
            f"; replacement(s) of local rank(s) {waiting} join when ready" if waiting else "",
            time.monotonic() - started,
        )
        return self._watch(plan)

    def _oom_kills_since_start(self) -> bool:
        now = oom_kill_count()
        return now is not None and self._oom_kills is not None and now > self._oom_kills

    def _report_raised_before(
        self, monitor: WorkerMonitor, exits: dict[int, int], stopping_at: float
    ) -> None:
        """As the world re-forms: report a user error that a worker raised before this agent
        stopped the workers. It may be the job's root cause (another node's agent re-formed
        the world on its collateral error first), and `dlrover diagnose` must show it; an
        error raised in answer to the stop (a SIGTERM handler) is not one."""
        assert self._plan is not None
        files = self._plan.error_files
        raised = {r: c for r, c in exits.items() if _written_before(files.get(r, ""), stopping_at)}
        if not raised:
            return
        verdict = self._judge(monitor, raised)
        if verdict.signature is not None:
            # The workers start again in the new round, whatever a restart would have been.
            self._report_failure(verdict, FailureAction.RESTART_PROCESSES)

    def _hung_collectives(self, verdict: Judgement) -> str:
        """A hang's collectives, per hung rank (`dlrover.agent.collectives`), as JSON ("": not
        a hang, or nothing recorded)."""
        monitor = self._monitor
        if verdict.failure_class is not FailureClass.HANG or monitor is None:
            return ""
        return json.dumps({str(rank): doc for rank, doc in monitor.collectives.items()})[:60_000]

    def _report_failure(self, verdict: Judgement, action: FailureAction | None = None) -> None:
        """Tell the master what failed, its class and the action (`dlrover diagnose`; the
        verdict's own unless ``action``); best-effort: an unreachable master costs the restart
        one RPC time-out, nothing more."""
        record = FailureRecord(
            time.time(),
            self.node_id,
            verdict.failure_class,
            (action or verdict.decision.action).value,
            f"{verdict.summary}\n{verdict.report}"[:4000],
            self.restart_count,
            signature=signature_text(verdict.signature),
            collectives=self._hung_collectives(verdict),
        )
        try:
            self.master.report_failure(self.node_id, self.incarnation, record)
        except Exception as e:  # the master may be restarting; the log has the failure
            logger.warning("could not report the failure to the master: %s", e)

    def _report_witness(self, why: str, collectives: dict[int, dict[str, Any]]) -> None:
        """This node's ranks wait in a collective for another node's: a hang record that asks
        for nothing (action ``none``), whose collectives let the master and `dlrover diagnose`
        name the rank the job waits for."""
        record = FailureRecord(
            time.time(),
            self.node_id,
            FailureClass.HANG,
            NO_ACTION,
            f"{why} (not restarted for it: the rank it waits for is judged by its own node)",
            self.restart_count,
            collectives=json.dumps({str(r): doc for r, doc in collectives.items()})[:60_000],
        )
        try:
            self.master.report_failure(self.node_id, self.incarnation, record)
        except Exception as e:  # only an explanation: the hang's own report is what acts
            logger.warning("could not tell the master what this node waits in: %s", e)

    def _register(self) -> None:
        registered = self._rdzv.register(self.node_id, self._host, self.run_id)
        self._heartbeat.stretch(registered.heartbeat_interval_s)
        if self.run_id == DEFAULT_JOB_NAME and registered.job_name:
            self.run_id = registered.job_name

    # --- flash checkpoint --------------------------------------------------------------------
    def _start_saver(self, shm_prefix: str, settings: CheckpointEnv) -> None:
        """Own the flash-checkpoint shared memory of this node, so it outlives worker crashes."""
        if not self.config.flash_checkpoint:
            return
        from dlrover.checkpoint.saver import CheckpointSaver

        self._saver = CheckpointSaver(
            socket_path=os.path.join(self._run_dir, "ckpt.sock"),
            shm_prefix=shm_prefix,
            coordinator=MasterCommitCoordinator(self.master, self._heartbeat.master_lost),
            peers=MasterPeerDirectory(self.master),
            replica_token=self._token or "",
            replica_host=self._host,
            replica_bandwidth=settings.replica_bytes_s,
            buffers=settings.buffers,
            shm_dir=settings.shm_dir,
            spill_dir=settings.spill_dir,
        )
        self._saver.start()

    def _persist_on_failure(self) -> None:
        """Before a restart: persist the newest step that only lives in memory."""
        if self._saver is None:
            return
        try:
            step = self._saver.persist_latest_if_newer()
        except Exception:  # the restart must happen even if storage is broken
            logger.exception("could not persist the in-memory checkpoint after the failure")
            return
        if step is not None:
            logger.info("persisted in-memory checkpoint step %d after the failure", step)

    # --- workers ---------------------------------------------------------------------------------
    def _start_workers(self, world: CommWorld) -> WorkerMonitor:
        cfg = self.config
        plan = plan_launch(cfg, world, self._attempt_context(self._attempt), os.environ)
        for files in plan.files:
            os.makedirs(os.path.dirname(files.error_file), exist_ok=True)
        zygote = self._ready_zygote(
            self.config.zygote_wait_s if self._attempt > 0 else DEFAULT_ZYGOTE_FIRST_WAIT_S
        )
        self._plan = plan
        self._group = group = WorkerGroup()
        self._joiners = {}
        self._worker_env = {w.local_rank: dict(w.env) for w in plan.launches}
        self._oom_kills = oom_kill_count()
        started = time.monotonic()
        group.start(plan.launches, zygote)
        self._started_at = started
        self._attempt += 1
        if self._faults is not None:
            self._faults.start_attempt(
                world.rank_offset,
                group.pids,
                self.restart_count,
                node_slot(self.node_id, cfg.requested_node_rank),
            )
        logger.info(
            "started %d workers (ranks %d..%d, restart %d): %s",
            cfg.nproc_per_node,
            world.rank_offset,
            world.rank_offset + cfg.nproc_per_node - 1,
            self.restart_count,
            " ".join(cfg.entrypoint),
        )
        if group.forked:
            logger.info(
                "forked %d workers from the zygote in %.3fs",
                group.forked,
                time.monotonic() - started,
            )
        return self._watch(plan)

    def _attempt_context(self, attempt: int) -> AttemptContext:
        hub = self._hub
        return AttemptContext(
            run_id=self.run_id,
            node_id=self.node_id,
            restart_count=self.restart_count,
            attempt=attempt,
            run_dir=self._run_dir,
            master_addr=self._master_addr,
            token=self._token,
            agent_pid=os.getpid(),
            saver_socket=self._saver.socket_path if self._saver is not None else None,
            recovery_socket=hub.path if hub is not None else None,
        )

    def _watch(self, plan: LaunchPlan) -> WorkerMonitor:
        """A monitor of the current group running ``plan``."""
        assert self._group is not None
        hub = self._hub
        self._monitor = WorkerMonitor(
            self._group,
            plan,
            self.config,
            MonitorSignals(
                stop_requested=self._heartbeat.stop_requested,
                reregister_requested=self._heartbeat.reregister_requested,
                master_lost=self._heartbeat.master_lost,
                world_must_reform=self._rdzv.world_must_reform,
                every_second=self._every_second,
                parked_unasked=(lambda: bool(hub.parked_unasked()))
                if hub is not None
                else (lambda: False),
                joiner_ready=lambda: bool(self._ready_joiners()),
                witness=self._report_witness,
            ),
            step=self.step_reached,
            history=self._hang_history,
        )
        return self._monitor

    def _every_second(self) -> None:
        if self._faults is not None:
            self._faults.tick(self._monitor.step if self._monitor is not None else -1)
        self._maybe_begin_zygote()
        self._save_hang_history()

    def _load_hang_history(self) -> None:
        """Take in the job's phase durations saved through the master (a restarted or
        replacement node learns its hang timeouts from them, not from the defaults)."""
        try:
            saved = HANG_HISTORY.get(self.master)
        except Exception as e:  # it only tunes timeouts: never a reason not to start
            logger.warning("could not read the job's hang-timeout history: %s", e)
            return
        if saved is not None:
            self._hang_history.merge(saved)

    def _save_hang_history(self, every_s: float = HANG_HISTORY_SAVE_S) -> None:
        """Save this node's phase durations through the master when they changed, at most
        every ``every_s``."""
        last_at, last = self._hang_history_saved
        now = time.monotonic()
        if now - last_at < every_s:
            return
        raw = self._hang_history.encode()
        self._hang_history_saved = (now, raw)
        if raw == last or not self._hang_history.phases():
            return
        try:
            self.master.kv_set(HANG_HISTORY.key_of(), raw)
        except Exception as e:  # the next save tries again
            logger.debug("could not save the hang-timeout history: %s", e)

    def _maybe_begin_zygote(self) -> None:
        """Take the zygote's ready message; start a new zygote where the first was lost (once
        the workers are `zygote_delay_s` into their attempt, or past their first step)."""
        if self._zygote is not None:
            self._note_zygote_ready()
            self._maybe_warm_zygote()
            return
        step = self._monitor.step if self._monitor is not None else -1
        if step < 0 and time.monotonic() - self._started_at < self.config.zygote_delay_s:
            return
        self._begin_zygote_now()

    def _begin_zygote_now(self) -> None:
        """Start the zygote (as the agent starts: its imports overlap the rendezvous, and the
        first workers fork from it too, so a node pays for one import of torch, and of the lazy
        modules a DDP step needs, instead of one per worker)."""
        if not self._fast_restart or self.config.script_argv is None:
            return
        try:
            self._zygote = Zygote.begin()
            self._zygote_warm_asked = False
        except (ZygoteError, OSError) as e:
            logger.warning("fast restarts are off: cannot start the zygote (%s)", e)
            self._fast_restart = False

    def _note_zygote_ready(self) -> None:
        """Once the zygote has finished its preload, take its ready message (which logs
        "zygote N ready"), so that the log says from when on restarts fork."""
        zygote = self._zygote
        if zygote is None or zygote.done or not zygote.wait_ready(0.0):
            return
        try:
            zygote.result(timeout=1.0)
        except ZygoteError as e:
            logger.warning("fast restarts are off: %s", e)
            self._zygote = None
            self._fast_restart = False

    def _maybe_warm_zygote(self) -> None:
        """Once this node's workers compile (or the job's compile cache says its nodes do), ask
        the ready zygote to warm inductor's compiler, once per zygote, so that restarted
        workers skip that work (`dlrover.agent.compiler_warmup`)."""
        zygote = self._zygote
        if zygote is None or self._zygote_warm_asked or not self._warm_compiler:
            return
        if not self._job_compiles:
            self._job_compiles = os.path.exists(compiler_in_use_marker(self._run_dir))
        if not self._job_compiles or not zygote.done or not zygote.wait_ready(0.0):
            return
        self._zygote_warm_asked = True
        try:
            zygote.result(timeout=1.0).warm_compiler()
        except ZygoteError as e:  # lost: the next zygote is asked in its turn
            logger.info("could not ask the zygote to warm the compiler: %s", e)

    def _ready_zygote(self, wait_s: float) -> Zygote | None:
        """The zygote if it is ready within `wait_s` (it may still be importing); otherwise the
        workers start afresh and the zygote serves later restarts."""
        if self._zygote is None:
            return None
        if not self._zygote.wait_ready(wait_s):
            logger.info(
                "the zygote is not ready after %.1fs; starting workers afresh this time", wait_s
            )
            return None
        try:
            zygote = self._zygote.result(timeout=60.0)
        except ZygoteError as e:
            logger.warning("restarting workers afresh: %s", e)
            self._zygote = None
            return None
        if not zygote.alive:
            logger.warning("the zygote is gone; restarting workers afresh")
            self._zygote = None
            return None
        self._maybe_warm_zygote()  # before the spawns, on the same channel: they fork warm
        return zygote

    # --- heartbeats ------------------------------------------------------------------------------
    def _heartbeat_report(self) -> HeartbeatReport:
        # The zygote is part of the node's use (its cgroup counts it): without it a sizing
        # window that ends while it still imports, before any worker is forked, measured only
        # the agent, and auto-scale sized nodes at ~70 MiB (found with the e2e stage under load).
        zygote = [self._zygote.pid] if self._zygote is not None else []
        workers = self._group.pids.values() if self._group is not None else ()
        cpu, mem = self._usage.sample([os.getpid(), *zygote, *workers])
        step = max(self.step_reached, self._monitor.step if self._monitor is not None else -1)
        return HeartbeatReport(
            node_id=self.node_id,
            incarnation=self.incarnation,
            cpu_percent=cpu,
            memory_bytes=mem,
            step=step,
            worker_state=self.state.value,
            restart_count=self.restart_count,
            step_time_s=self._monitor.step_time_s if self._monitor is not None else 0.0,
            checkpoint_persist_s=self._saver.last_persist_s if self._saver is not None else 0.0,
            worker_pids=tuple(pid for _, pid in sorted(self._group.pids.items()))
            if self._group is not None
            else (),
            **_attempt_progress(self._monitor),
        )


def _attempt_progress(monitor: WorkerMonitor | None) -> dict[str, Any]:
    """The heartbeat's view of the current workers' steps (goodput; see HeartbeatReport)."""
    if monitor is None or monitor.attempt_first is None:
        return {}
    now = time.time()
    first_step, first_at = monitor.attempt_first
    parts = monitor.breakdown
    return {
        "step_wall_s": parts.wall_s,
        "step_data_s": parts.data_s,
        "step_checkpoint_s": parts.checkpoint_s,
        "samples_per_s": parts.samples_per_s,
        "attempt_step": monitor.attempt_step,
        "attempt_step_age_s": max(0.0, now - monitor.attempt_step_at),
        "attempt_first_step": first_step,
        "attempt_first_age_s": max(0.0, now - first_at),
    }


def signature_text(signature: UserErrorSignature | None) -> str:
    """A user error's signature as the master keeps it (`FailureRecord.signature`)."""
    if signature is None:
        return ""
    return f"{signature.exception_type} at {signature.location or 'an unknown place'}"


def install_signal_handlers() -> None:
    """Turn SIGTERM/SIGINT into an exception on the main thread so workers get stopped."""

    def handler(signum: int, frame: object) -> None:
        raise SignalReceived(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    if sys.platform != "win32":
        signal.signal(signal.SIGHUP, handler)


def _written_before(path: str, moment: float) -> bool:
    """Whether the file at ``path`` exists and was last written before ``moment`` (epoch s)."""
    try:
        return os.path.getmtime(path) < moment
    except OSError:
        return False
