"""The elastic agent of one node: rendezvous, start workers, watch them, restart, finish."""

from __future__ import annotations

import logging
import os
import queue
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from dlrover.agent.bootstrap import ENV_DONE_FILE
from dlrover.agent.config import AgentConfig
from dlrover.agent.failure_policy import UserErrorSignature
from dlrover.agent.failures import judge
from dlrover.agent.heartbeat import Heartbeat, usage_of
from dlrover.agent.progress_watch import ProgressWatch, Stall
from dlrover.agent.stacks import collect_stacks, cpu_seconds
from dlrover.agent.worker_env import WorkerPlacement, worker_env
from dlrover.agent.workers import WorkerExit, WorkerGroup, WorkerLaunch
from dlrover.agent.zygote import PendingZygote, Zygote, ZygoteError
from dlrover.client.checkpoint import MasterCommitCoordinator
from dlrover.client.master_client import MasterClient, MasterClientError
from dlrover.constants import (
    DEFAULT_JOB_NAME,
    ENV_AGENT_PID,
    ENV_CHECKPOINT_SOCKET,
    ENV_NODE_NAME,
    ENV_STACK_FILE,
    ENV_STEP_FILE,
)
from dlrover.decisions import FailureAction
from dlrover.proto import master_pb2 as pb
from dlrover.trainer.progress import read_step_file

logger = logging.getLogger(__name__)


class AgentError(Exception):
    """The agent cannot go on (rendezvous timed out, the master refused the node...)."""


class RendezvousTimeoutError(AgentError):
    """Not enough nodes joined within the join timeout."""


class SignalReceived(Exception):
    """SIGTERM/SIGINT reached the agent: workers are stopped, the agent exits."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


@dataclass
class RunResult:
    """How the agent's run ended."""

    exit_code: int
    reason: str = ""


def free_port() -> int:
    """A port that was free a moment ago on every interface (the rank-0 worker binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def describe_exit(e: WorkerExit) -> str:
    if e.returncode < 0:
        try:
            return f"killed by {signal.Signals(-e.returncode).name}"
        except ValueError:
            return f"killed by signal {-e.returncode}"
    return f"exit code {e.returncode}"


class ElasticAgent:
    """Runs the workers of one node for the life of the job.

    Loop: join a rendezvous round -> start `nproc_per_node` workers with torchrun's env ->
    watch them. A failed worker restarts the whole local group after a new round (bounded by
    max_restarts); a membership change (a node waits to join, or a known node came back)
    re-forms without using up a restart; success ends in an exit barrier.
    """

    def __init__(self, config: AgentConfig, client: MasterClient, master_addr: str, token: str):
        self.config = config
        self.client = client
        self._master_addr = master_addr
        self._token = token
        # An engine names the node it launched; otherwise the master picks an id.
        self.node_id = os.environ.get(ENV_NODE_NAME, "")
        self.incarnation = 0
        self.run_id = config.run_id
        """TORCHELASTIC_RUN_ID: --rdzv-id, or without one the job name the master reports."""
        self.restart_count = 0
        self._attempt = 0
        self._round = 0
        self._group: WorkerGroup | None = None
        self._heartbeat = Heartbeat(client, config.heartbeat_interval_s, self._heartbeat_request)
        self._master_says_stop = self._heartbeat.stop_requested
        self._must_reregister = self._heartbeat.reregister_requested
        self._host = config.local_addr or self._guess_host()
        self._run_dir = ""
        self._step_files: list[str] = []
        self._stack_files: list[str] = []
        self._progress = ProgressWatch(0, time.time())
        self._done_files: dict[int, str] = {}
        self._error_files: dict[int, str] = {}
        self._history: list[UserErrorSignature | None] = []
        self._zygote: PendingZygote | None = None
        self._saver: Any = None
        self._hung: list[int] = []
        self._rank_offset = 0
        self._started_at = time.monotonic()
        self.step = -1

    def _guess_host(self) -> str:
        host = self._master_addr.rsplit(":", 1)[0].strip("[]")
        if host in ("127.0.0.1", "localhost", "::1"):
            return "127.0.0.1"
        return socket.getfqdn()

    # --- lifecycle -------------------------------------------------------------------------------
    def run(self) -> RunResult:
        self._register()
        self._run_dir = tempfile.mkdtemp(prefix="dlrover_agent_")
        self._start_saver()
        self._heartbeat.start()
        try:
            return self._run_loop()
        finally:
            if self._group is not None:
                self._group.stop(self.config.stop_grace_s)
            self._heartbeat.stop()
            if self._zygote is not None:
                self._zygote.cancel()
            if self._saver is not None:
                # Persists already queued (the last checkpoint) finish before the memory goes.
                self._saver.close(unlink=True, timeout=self.config.checkpoint_close_timeout_s)
            shutil.rmtree(self._run_dir, ignore_errors=True)

    def _start_saver(self) -> None:
        """Own the flash-checkpoint shared memory of this node, so it outlives worker crashes."""
        if not self.config.flash_checkpoint:
            return
        from dlrover.checkpoint.saver import CheckpointSaver

        self._saver = CheckpointSaver(
            socket_path=os.path.join(self._run_dir, "ckpt.sock"),
            shm_prefix=f"dlrover-{os.getpid()}-ckpt",
            coordinator=MasterCommitCoordinator(self.client),
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

    def _register(self) -> None:
        cfg = self.config
        resp = self.client.register_node(
            pb.RegisterNodeRequest(
                node_id=self.node_id,
                host=self._host,
                role=cfg.role,
                local_world_size=cfg.nproc_per_node,
                requested_rank=cfg.requested_node_rank,
                pid=os.getpid(),
                config=pb.JobConfig(
                    min_nodes=cfg.min_nodes,
                    max_nodes=cfg.max_nodes,
                    node_unit=cfg.node_unit,
                    last_call_timeout_s=cfg.last_call_timeout_s,
                    job_name=self.run_id,
                ),
            )
        )
        self.node_id, self.incarnation = resp.node_id, resp.incarnation
        if self.run_id == DEFAULT_JOB_NAME and resp.config.job_name:
            self.run_id = resp.config.job_name
        logger.info("registered as node %s (incarnation %d)", self.node_id, self.incarnation)

    def _run_loop(self) -> RunResult:
        cfg = self.config
        while True:
            world = self._rendezvous()
            self._start_workers(world)
            outcome = self._monitor()
            assert self._group is not None
            if outcome == "succeeded":
                self._group.close()
                return self._finish_success()
            if outcome == "stop":
                self._group.stop(cfg.stop_grace_s)
                status = self.client.get_job_status()
                code = 0 if status.state == "succeeded" else (status.exit_code or 1)
                return RunResult(code, f"the master ended the job: {status.reason}")
            if outcome == "reregister":
                # The master took this node for lost (or restarted without it): join afresh.
                logger.warning("the master lost track of this node; registering again")
                self._group.stop(cfg.stop_grace_s)
                self._must_reregister.clear()
                self._register()
                continue
            if outcome == "membership":
                logger.info("membership changed: re-forming the world (no restart used)")
                self._group.stop(cfg.stop_grace_s)
                continue
            # A worker failed or hung: the policy decides between a restart and failing fast.
            exits = self._stop_and_collect_failures()
            verdict = judge(
                exits,
                self._error_files,
                self._hung,
                self.restart_count,
                cfg.max_restarts,
                self._history,
                self.node_id,
            )
            self._history.append(verdict.signature)
            self._persist_on_failure()
            if verdict.decision.action is FailureAction.RESTART_PROCESSES:
                self.restart_count += 1
                logger.warning(
                    "restarting workers: %s\n%s", verdict.decision.reason, verdict.report
                )
                continue
            logger.error("giving up: %s", verdict.decision.reason)
            self._report_status("failed", verdict.exit_code, verdict.decision.reason)
            return RunResult(verdict.exit_code, f"{verdict.decision.reason}\n{verdict.report}")

    # --- rendezvous ------------------------------------------------------------------------------
    def _rendezvous(self) -> pb.CommWorld:
        cfg = self.config
        store_host = cfg.store_addr or self._host
        store_port = cfg.store_port or free_port()
        self._round = self.client.join_rendezvous(
            pb.JoinRendezvousRequest(
                node_id=self.node_id,
                incarnation=self.incarnation,
                local_world_size=cfg.nproc_per_node,
                store_host=store_host,
                store_port=store_port,
            )
        )
        start = time.monotonic()
        deadline = start + cfg.join_timeout_s
        next_log = start + 10.0
        delay = 0.01
        while True:
            world = self.client.get_comm_world(self.node_id, self._round)
            if world.complete:
                self._round = world.round
                logger.info(
                    "round %d: node rank %d of %d nodes, world size %d (%.2fs)",
                    world.round,
                    world.node_rank,
                    len(world.members),
                    world.world_size,
                    time.monotonic() - start,
                )
                return world
            now = time.monotonic()
            if self._master_says_stop.is_set():
                raise AgentError("the master ended the job while this node waited to join")
            if now >= deadline:
                raise RendezvousTimeoutError(
                    f"rendezvous round {self._round} did not complete within {cfg.join_timeout_s:.0f}s: "
                    f"the job needs at least {cfg.min_nodes} nodes; start the missing nodes or "
                    "lower --nnodes MIN (join_timeout in --rdzv-conf sets this deadline)"
                )
            if now >= next_log:
                logger.info(
                    "waiting for nodes to join round %d (need %d)", self._round, cfg.min_nodes
                )
                next_log = now + 10.0
            time.sleep(delay)
            delay = min(delay * 2, 0.1)

    # --- workers ---------------------------------------------------------------------------------
    def _start_workers(self, world: pb.CommWorld) -> None:
        cfg = self.config
        attempt_dir = ""
        if cfg.log_dir:
            attempt_dir = os.path.join(cfg.log_dir, self.run_id, f"attempt_{self._attempt}")
        launches = []
        self._step_files, self._stack_files = [], []
        self._done_files, self._error_files, self._hung = {}, {}, []
        for local_rank in range(cfg.nproc_per_node):
            rank = world.rank_offset + local_rank
            placement = WorkerPlacement(
                local_rank=local_rank,
                local_world_size=cfg.nproc_per_node,
                rank=rank,
                world_size=world.world_size,
                node_rank=world.node_rank,
                num_nodes=len(world.members),
            )
            log_dir = os.path.join(attempt_dir, f"rank_{rank}") if attempt_dir else None
            env = worker_env(
                os.environ,
                placement,
                role=cfg.role,
                run_id=self.run_id,
                restart_count=self.restart_count,
                max_restarts=cfg.max_restarts,
                store_addr=world.store_host,
                store_port=world.store_port,
                error_file=os.path.join(
                    log_dir
                    or os.path.join(self._run_dir, f"attempt_{self._attempt}", f"rank_{rank}"),
                    "error.json",
                ),
                master_addr=self._master_addr,
                job_token=self._token,
                node_id=self.node_id,
                rdzv_round=world.round,
            )
            step_file = os.path.join(self._run_dir, f"step.{self._attempt}.{local_rank}")
            env[ENV_STEP_FILE] = step_file
            env[ENV_STACK_FILE] = os.path.join(self._run_dir, f"stacks.{self._attempt}.{local_rank}")
            self._stack_files.append(env[ENV_STACK_FILE])
            env[ENV_AGENT_PID] = str(os.getpid())
            if self._saver is not None:
                env[ENV_CHECKPOINT_SOCKET] = self._saver.socket_path
            env.pop(ENV_NODE_NAME, None)
            env[ENV_DONE_FILE] = os.path.join(self._run_dir, f"done.{self._attempt}.{local_rank}")
            os.makedirs(os.path.dirname(env["TORCHELASTIC_ERROR_FILE"]), exist_ok=True)
            self._done_files[local_rank] = env[ENV_DONE_FILE]
            self._error_files[rank] = env["TORCHELASTIC_ERROR_FILE"]
            self._step_files.append(step_file)
            launches.append(
                WorkerLaunch(
                    local_rank=local_rank,
                    rank=rank,
                    argv=cfg.entrypoint,
                    env=env,
                    log_dir=log_dir,
                    redirect=cfg.redirects.get(local_rank, cfg.default_redirect),
                    tee=cfg.tee.get(local_rank, cfg.default_tee),
                    prefix=f"[{cfg.role}{local_rank}]:",
                    script_argv=cfg.script_argv,
                )
            )
        self._rank_offset = world.rank_offset
        zygote = self._ready_zygote() if self._attempt > 0 else None
        self._group = WorkerGroup()
        started = time.monotonic()
        self._group.start(launches, zygote)
        self._started_at = started
        self._progress = ProgressWatch(cfg.nproc_per_node, time.time())
        self._attempt += 1
        logger.info(
            "started %d workers (ranks %d..%d, restart %d): %s",
            cfg.nproc_per_node,
            world.rank_offset,
            world.rank_offset + cfg.nproc_per_node - 1,
            self.restart_count,
            " ".join(cfg.entrypoint),
        )
        if self._group.forked:
            logger.info(
                "forked %d workers from the zygote in %.3fs",
                self._group.forked,
                time.monotonic() - started,
            )

    def _maybe_begin_zygote(self) -> None:
        """Start the template process once the workers are past their imports (so its own
        imports do not slow the first start), to fork restarted workers in milliseconds."""
        cfg = self.config
        if self._zygote is not None or not cfg.fast_restart or cfg.script_argv is None:
            return
        if self.step < 0 and time.monotonic() - self._started_at < cfg.zygote_delay_s:
            return
        try:
            self._zygote = Zygote.begin()
        except (ZygoteError, OSError) as e:
            logger.warning("fast restarts are off: cannot start the zygote (%s)", e)
            cfg.fast_restart = False

    def _ready_zygote(self) -> Zygote | None:
        """The zygote if it is ready within `zygote_wait_s` (it may still be importing at low
        priority); otherwise the workers start afresh and the zygote serves later restarts."""
        if self._zygote is None:
            return None
        if not self._zygote.wait_ready(self.config.zygote_wait_s):
            logger.info(
                "the zygote is not ready after %.1fs; starting workers afresh this time",
                self.config.zygote_wait_s,
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
        return zygote

    def _monitor(self) -> str:
        """Block until the group succeeds, a worker fails, membership changes, or the master stops us."""
        assert self._group is not None
        group = self._group
        done: dict[int, WorkerExit] = {}
        next_progress_check = 0.0
        next_membership_check = 0.0
        while True:
            try:
                ex = group.exits.get(timeout=self.config.monitor_interval_s)
            except queue.Empty:
                ex = None
            if ex is not None:
                done[ex.local_rank] = ex
                group.returncodes[ex.local_rank] = ex.returncode
                if ex.returncode != 0 and os.path.exists(self._done_files.get(ex.local_rank, "")):
                    logger.warning(
                        "worker rank %d %s during interpreter shutdown after its script finished; "
                        "counted as succeeded",
                        ex.rank,
                        describe_exit(ex),
                    )
                    group.returncodes[ex.local_rank] = 0
                    ex.returncode = 0
                if ex.returncode != 0:
                    logger.error("worker rank %d (pid %d) %s", ex.rank, ex.pid, describe_exit(ex))
                    return "failed"
                if len(done) == self.config.nproc_per_node:
                    return "succeeded"
                continue
            if self._master_says_stop.is_set():
                return "stop"
            if self._must_reregister.is_set():
                return "reregister"
            if time.monotonic() >= next_progress_check:
                next_progress_check = time.monotonic() + 1.0
                if self._check_progress(done):
                    return "hang"
                self._maybe_begin_zygote()
            if time.monotonic() < next_membership_check:
                continue
            # Worker exits are seen at once from the queue above; asking the master about
            # membership is rarer, so a big job does not send it 10 RPCs per node per second.
            next_membership_check = time.monotonic() + self.config.membership_check_interval_s
            try:
                waiting = self.client.num_nodes_waiting(self.node_id, self._round)
            except MasterClientError as e:
                logger.warning("cannot ask the master about membership: %s", e)
                continue
            if waiting.waiting > 0 or waiting.latest_round > self._round:
                return "membership"

    def _check_progress(self, done: dict[int, WorkerExit]) -> bool:
        """Update the node's step and the workers' progress; True when a worker hangs (the
        opt-in --hang-timeout). Workers without progress for --hang-warning-timeout get a
        warning with their stacks, once per stall, and keep running."""
        assert self._group is not None
        cfg = self.config
        now = time.time()
        pids = self._group.pids
        watch_cpu = cfg.hang_warning_timeout_s > 0
        for local_rank, path in enumerate(self._step_files):
            record = read_step_file(path)
            if record is not None:
                self.step = max(self.step, record[0])
            pid = pids.get(local_rank)
            cpu = cpu_seconds(pid) if watch_cpu and pid and local_rank not in done else None
            self._progress.observe(local_rank, record, cpu, now)
        stale = self._progress.hung(cfg.hang_timeout_s, now, set(done))
        if stale:
            logger.error(
                "hang: local ranks %s reported no step for %.0fs (last step %d); their stacks:\n%s",
                stale,
                cfg.hang_timeout_s,
                self.step,
                self._stacks_text(stale),
            )
            self._hung = [self._rank_offset + lr for lr in stale]
            return True
        stalls = self._progress.new_stalls(cfg.hang_warning_timeout_s, now, set(done))
        if stalls:
            self._warn_stalls(stalls)
        return False

    def _warn_stalls(self, stalls: list[Stall]) -> None:
        ranks = ", ".join(str(self._rank_offset + stall.local_rank) for stall in stalls)
        logger.warning(
            "no progress on rank(s) %s for %.0fs: %s. The job goes on; pass --hang-timeout S to "
            "restart workers that report no step for S seconds. Their Python stacks:\n%s",
            ranks,
            self.config.hang_warning_timeout_s,
            "; ".join(stall.describe(self._rank_offset) for stall in stalls),
            self._stacks_text([stall.local_rank for stall in stalls]),
        )

    def _stacks_text(self, local_ranks: list[int]) -> str:
        """Every thread's Python stack of these workers (asked by signal, read from their files)."""
        if self._group is None:
            return ""
        pids = self._group.pids
        targets = {
            lr: (pids[lr], self._stack_files[lr]) for lr in local_ranks if lr in pids
        }
        dumps = collect_stacks(targets)
        return "\n".join(
            f"--- rank {self._rank_offset + lr} (pid {targets[lr][0]}) ---\n{dumps[lr]}"
            for lr in sorted(dumps)
        )

    def _stop_and_collect_failures(self) -> dict[int, int]:
        """Stop the group and return global rank -> return code of the workers that failed.

        No fixed wait: exits already queued are taken, the group is stopped at once, and of the
        exits that follow only those not caused by our own signals count (the root cause is
        picked by error-file time later). Hung workers count as killed by us.
        """
        assert self._group is not None
        group = self._group
        exits = {self._rank_offset + lr: rc for lr, rc in group.returncodes.items() if rc != 0}

        def drain(ours: tuple[int, ...]) -> None:
            while True:
                try:
                    ex = group.exits.get_nowait()
                except queue.Empty:
                    return
                if ex.returncode != 0 and ex.returncode not in ours:
                    exits.setdefault(ex.rank, ex.returncode)

        drain(())
        group.stop(self.config.stop_grace_s)
        drain((-signal.SIGTERM, -signal.SIGKILL))
        for rank in self._hung:
            exits.setdefault(rank, -signal.SIGKILL)
        return exits

    # --- the end ---------------------------------------------------------------------------------
    def _finish_success(self) -> RunResult:
        logger.info(
            "all %d workers succeeded; waiting for the other nodes", self.config.nproc_per_node
        )
        done = self._report_status("succeeded", 0, "")
        deadline = time.monotonic() + self.config.exit_barrier_timeout_s
        delay = 0.01
        while not done:
            status = self.client.get_job_status()
            if status.state in ("succeeded", "failed"):
                done = True
                if status.state == "failed":
                    return RunResult(status.exit_code or 1, status.reason)
                break
            if time.monotonic() >= deadline:
                logger.warning(
                    "exit barrier: other nodes did not finish within %.0fs; exiting anyway",
                    self.config.exit_barrier_timeout_s,
                )
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
        return RunResult(0, "succeeded")

    def _report_status(self, status: str, code: int, reason: str) -> bool:
        try:
            return self.client.report_node_status(
                pb.ReportNodeStatusRequest(
                    node_id=self.node_id,
                    incarnation=self.incarnation,
                    status=status,
                    exit_code=code,
                    reason=reason,
                )
            )
        except MasterClientError as e:
            logger.warning("could not report %s to the master: %s", status, e)
            return False

    # --- heartbeats ------------------------------------------------------------------------------
    def _heartbeat_request(self) -> pb.HeartbeatRequest:
        pids = [os.getpid(), *(self._group.pids.values() if self._group is not None else ())]
        cpu, mem = usage_of(pids)
        return pb.HeartbeatRequest(
            node_id=self.node_id,
            incarnation=self.incarnation,
            usage=pb.ResourceUsage(cpu_percent=cpu, memory_bytes=mem),
            step=self.step,
            restart_count=self.restart_count,
        )


def install_signal_handlers() -> None:
    """Turn SIGTERM/SIGINT into an exception on the main thread so workers get stopped."""

    def handler(signum: int, frame: object) -> None:
        raise SignalReceived(signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    if sys.platform != "win32":
        signal.signal(signal.SIGHUP, handler)
