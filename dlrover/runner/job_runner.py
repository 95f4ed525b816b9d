"""`JobRunner`: one job's master, engine and controllers, started, stepped and ended from Python."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from dlrover import constants as c
from dlrover.checkpoint.leftovers import sweep_configured
from dlrover.engines.base import Engine
from dlrover.engines.registry import BUILTIN_ENGINES, EngineKind, EngineRegistry
from dlrover.envvars import number_from_env
from dlrover.jobspec import JobSpec, JobSpecError, RoleSpec
from dlrover.master.assembly import MasterSettings, RunningMaster, build_master
from dlrover.master.job import JobMaster, JobState
from dlrover.master.local_api import LocalMasterApi
from dlrover.master.node_controller import NodeController
from dlrover.master.optimizer import OptimizerConfig, ResourceOptimizer
from dlrover.master.relaunch_policy import OomPolicy, RelaunchPolicy
from dlrover.master.rendezvous import RendezvousConfig
from dlrover.master.server import MasterServerError, new_token
from dlrover.master.slot_supervisor import SlotSupervisor
from dlrover.master.state_store import StateStoreError
from dlrover.master.stragglers import DEFAULT_REPORT_S
from dlrover.master.tensorboard import TensorBoardError
from dlrover.master.tf_controller import TfController
from dlrover.master.tf_scaling import TfPsScaler, TfWorkerScaler
from dlrover.master.web import WebError
from dlrover.processes import pid_alive
from dlrover.runner.records import (
    FinalState,
    JobRecord,
    has_record,
    job_dir,
    read_record,
    remove_final,
    write_final,
    write_history,
    write_record,
)

if TYPE_CHECKING:
    from dlrover.master.autoscaler import AutoScaler
    from dlrover.master.tf_sizing import TfSizer

logger = logging.getLogger(__name__)

EXIT_FENCED = 3
"""Exit code of a master that another master took its job's state from."""


class JobRunnerError(Exception):
    """The job could not be run; the message says why and what to do. ``exit_code`` is what a
    command that ran it exits with."""

    exit_code = 1


class JobSettingsError(JobRunnerError):
    """A setting from the environment cannot be read (the message names the variable)."""

    exit_code = 2


class JobAlreadyRunningError(JobRunnerError):
    """A live master serves a job of this name on this machine already."""


class MasterStartError(JobRunnerError):
    """The master cannot start (port, state, dashboard or TensorBoard directory)."""


class EngineStartError(JobRunnerError):
    """The engine cannot start; the job is recorded as failed."""


@dataclasses.dataclass(frozen=True)
class RunnerSettings:
    """How the runner serves its job's master (the job itself is the `JobSpec`)."""

    host: str = "0.0.0.0"
    """Where the master listens."""
    port: int = 0
    """The master's port (0: a free one)."""
    advertise: str = ""
    """``host[:port]`` nodes reach the master by ("": the engine kind's `master_host`)."""
    token: str = ""
    """The job token ("": $DLROVER_JOB_TOKEN, else a new one)."""
    relaunch_delay_s: float = 0.0
    """Wait this long before replacing a lost node (back-off against crash loops)."""
    state: str = ""
    """The master's state (SQLite path or redis://...). One that holds this job already resumes
    it (nodes, round, commits, each slot's attempt, which the engine adopts); "": a fresh state
    in the job's directory."""
    metrics_port: int | None = 0
    """Where /metrics and the dashboard are served (0: a free port; None: nowhere)."""
    tensorboard_dir: str = ""
    """Also write metrics as TensorBoard events there ("": not)."""
    heartbeat_port: int | None = 0
    """The port of the master's heartbeat server (`HeartbeatLane`; 0: a free one; None: none)."""


@dataclasses.dataclass(frozen=True)
class JobOutcome:
    """How a job ended for this runner."""

    state: str
    """The job's final state (``succeeded``, ``failed``), or ``fenced``."""
    reason: str
    exit_code: int
    """0 when it succeeded; the job's exit code (at least 1) when it failed; EXIT_FENCED when
    another master took the job over."""
    fenced_by: str = ""
    """The master that took over (``fenced`` only)."""
    served: bool = True
    """False when the job had ended before this runner started (nothing was served)."""


def check_not_running(name: str) -> None:
    """Raise JobAlreadyRunningError if a live process other than this one serves job ``name``."""
    if not has_record(name):
        return
    old = read_record(name)
    # (A restarted container may reuse the old pid: that is us, not another master.)
    if not old.ended and old.pid != os.getpid() and pid_alive(old.pid):
        raise JobAlreadyRunningError(
            f"job {name!r} is already running (pid {old.pid}); "
            f"`dlrover stop {name}` first, or give the job another name"
        )


def env_seconds(name: str, default: float) -> float:
    """A duration from the environment variable ``name`` (unset or empty: ``default``)."""
    try:
        return number_from_env(name, default, f"a number of seconds (e.g. {default:g})")
    except ValueError as e:
        raise JobSpecError(str(e)) from None


def autoscale_settings(spec: JobSpec) -> tuple[OptimizerConfig, float, float] | None:
    """The auto-scaler's policy knobs, interval and rate window (environment), or None without
    ``auto_scale``. Raises JobSpecError naming a variable that is not a duration."""
    if not spec.auto_scale:
        return None
    from dlrover.master.autoscaler import DEFAULT_INTERVAL_S, DEFAULT_WINDOW_S

    config = OptimizerConfig(
        spec.min_nodes,
        spec.max_nodes,
        sizing_window_s=env_seconds(c.ENV_AUTOSCALE_SIZING_S, 60.0),
        cooldown_s=env_seconds(c.ENV_AUTOSCALE_COOLDOWN_S, 300.0),
    )
    return (
        config,
        env_seconds(c.ENV_AUTOSCALE_INTERVAL_S, DEFAULT_INTERVAL_S),
        env_seconds(c.ENV_AUTOSCALE_WINDOW_S, DEFAULT_WINDOW_S),
    )


def worker_scaler(
    job: JobMaster,
    controller: TfController,
    engine: Engine,
    workers: RoleSpec,
    scaling: tuple[OptimizerConfig, float, float],
) -> TfWorkerScaler:
    """The auto-scaler of a TensorFlow job's workers, within ``count..max_count``, with the
    policy knobs, plan interval and rate window of the job's ``auto_scale`` settings."""
    config, interval_s, window_s = scaling
    config = dataclasses.replace(
        config,
        min_nodes=workers.count,
        max_nodes=workers.max_count,
        unit="worker",
        rate_unit="samples/s",
    )
    optimizer = ResourceOptimizer(config, time.monotonic)
    cores = float(os.cpu_count() or 1)
    return TfWorkerScaler(
        job, controller, optimizer, engine.capacity, cores, interval_s, window_s, time.monotonic
    )


def straggler_report_s() -> float:
    """How often the master scores stragglers ($DLROVER_STRAGGLER_REPORT_S)."""
    return float(os.environ.get(c.ENV_STRAGGLER_REPORT_S, "") or DEFAULT_REPORT_S)


def final_state(job: JobMaster) -> FinalState:
    """What ``dlrover status`` shows of ``job`` once it ended: its node table, the scale plans
    acted on and its failures."""
    return FinalState(
        status=LocalMasterApi(job).get_job_status(),
        plans=tuple(
            (at, text) for at, kind, text in list(job.diagnostics.events) if kind == "scale"
        ),
        failures=job.diagnostics.get_failures(),
    )


def advertise_address(kind: EngineKind[object], port: int, explicit: str) -> str:
    """``host:port`` nodes reach the master by: ``explicit`` (its port added if it has none),
    else the engine kind's master host."""
    if explicit:
        return explicit if ":" in explicit else f"{explicit}:{port}"
    return f"{kind.master_host()}:{port}"


class JobRunner:
    """Runs one job: `start()` serves its master and launches its nodes through the engine,
    `step()` drives the controllers once, `run()` steps until the job ends and closes
    everything, `outcome()` says how it ended. Prints nothing: the CLI (`dlrover submit`,
    `dlrover-master --job-spec`, the Ray master actor) says what it wants around it.

    Invariant: once `start()` returned True, `close()` (which `run()` calls) stops the master,
    closes the engine (deleting the nodes unless another master took the job over) and records
    the job's end; it runs once.
    """

    def __init__(
        self,
        spec: JobSpec,
        settings: RunnerSettings | None = None,
        engine: Engine | None = None,
        engines: EngineRegistry = BUILTIN_ENGINES,
        on_serving: Callable[[JobRunner], None] | None = None,
    ) -> None:
        """``engine``: drive this engine instead of the one ``spec.engine`` names in
        ``engines``. ``on_serving`` is called once the master serves, before the engine starts
        (a host prints the master's address there, and takes the job to stop it)."""
        self.spec = spec
        self.settings = settings or RunnerSettings()
        self.kind = engines.get(spec.engine)
        self._engine = engine
        self._on_serving = on_serving
        self._stop = threading.Event()
        self._master: RunningMaster | None = None
        self._controller: NodeController | TfController | None = None
        self._closed = False
        self._outcome: JobOutcome | None = None
        self.master_addr = ""
        """``host:port`` the nodes reach the master by (set by `start`)."""
        self.token = ""
        """The job token (set by `start`)."""
        self._started_at = 0.0

    # --- what a host reads --------------------------------------------------------------------
    @property
    def master(self) -> RunningMaster:
        """The running master (after `start`)."""
        if self._master is None:
            raise RuntimeError("JobRunner.start() first")
        return self._master

    @property
    def job(self) -> JobMaster:
        """The job's state machine (after `start`)."""
        return self.master.job

    @property
    def fenced(self) -> bool:
        """Whether another master took the job's state over (this one must touch nothing)."""
        return self._master is not None and self._master.server.fenced.is_set()

    # --- the life of a job --------------------------------------------------------------------
    def start(self) -> bool:
        """Serve the master, record the job, start the engine and launch the nodes. Returns False
        when the state holds a job that already ended (a master restarted after the end): then
        nothing is served and `outcome()` says how it ended.

        Raises JobSettingsError, JobAlreadyRunningError, MasterStartError, EngineStartError."""
        spec, settings = self.spec, self.settings
        try:
            scaling = autoscale_settings(spec)
        except JobSpecError as e:
            raise JobSettingsError(str(e)) from None
        directory = job_dir(spec.name)
        check_not_running(spec.name)
        directory.mkdir(parents=True, exist_ok=True)
        db = directory / "master.db"
        if not settings.state:
            for stale in (db, db.with_name("master.db-wal"), db.with_name("master.db-shm")):
                stale.unlink(missing_ok=True)  # a new submission starts from a clean state
            remove_final(spec.name)
        self.token = settings.token or os.environ.get(c.ENV_JOB_TOKEN, "") or new_token()
        try:
            master = build_master(
                MasterSettings(
                    job_name=spec.name,
                    token=self.token,
                    host=settings.host,
                    port=settings.port,
                    state=settings.state or str(db),
                    rendezvous=RendezvousConfig(spec.min_nodes, spec.max_nodes),
                    owns_process=True,
                    exclude_stragglers=spec.exclude_straggler,
                    straggler_report_s=straggler_report_s(),
                    metrics_port=settings.metrics_port,
                    tensorboard_dir=settings.tensorboard_dir,
                    log_reader=self.kind.logs(directory),
                    heartbeat_port=settings.heartbeat_port,
                ),
                on_fenced=lambda newer: self._stop.set(),
            )
        except (MasterServerError, WebError, TensorBoardError, StateStoreError) as e:
            raise MasterStartError(str(e)) from None
        self._master = master
        job = master.job
        if job.lifecycle.ended.is_set():
            # A master restarted after the job's end (its container's OnFailure restart after a
            # failed job): the run that ended it reported the outcome; do not loop on it.
            master.stop(0.5)
            self._closed = True
            self._outcome = JobOutcome(
                job.lifecycle.state.value, job.lifecycle.reason, 0, served=False
            )
            return False
        self.master_addr = advertise_address(self.kind, master.port, settings.advertise)
        if master.web is not None:
            logger.info(
                "job %s: metrics and dashboard on http://%s:%d/",
                spec.name,
                self.master_addr.rsplit(":", 1)[0],
                master.web.port,
            )
        self._started_at = time.time()
        write_record(
            JobRecord(
                name=spec.name,
                state="running",
                pid=os.getpid(),
                master_addr=self.master_addr,
                token=self.token,
                engine=spec.engine,
                web_port=master.web.port if master.web is not None else 0,
                started_at=self._started_at,
            )
        )
        if self._on_serving is not None:
            self._on_serving(self)
        try:
            engine = self._engine or self.kind.create(spec.name, directory, spec.engine_settings)
        except Exception as e:  # an engine that cannot start is the job's failure, said plainly
            job.lifecycle.stop(f"cannot start engine {spec.engine}: {e}")
            master.stop(0.5)
            write_record(
                JobRecord(
                    name=spec.name,
                    state="failed",
                    pid=os.getpid(),
                    engine=spec.engine,
                    started_at=self._started_at,
                    ended_at=time.time(),
                )
            )
            self._closed = True
            raise EngineStartError(f"cannot start engine {spec.engine}: {e}") from e
        logs = engine.logs()
        if logs is not None and master.web is not None:
            master.web.log_reader = logs  # the engine reads where its nodes run (Ray: actors)
        self._controller = self._controllers(engine, scaling)
        try:
            if isinstance(self._controller, NodeController) and self._controller.ps is not None:
                self._controller.ps.start()  # the workers wait for the servers' placement
            self._controller.start()
        except BaseException:
            self._finish()
            raise
        return True

    def _controllers(
        self, engine: Engine, scaling: tuple[OptimizerConfig, float, float] | None
    ) -> NodeController | TfController:
        """The controller that drives the job's nodes: a TfController for a TensorFlow job, else
        a NodeController (with its auto-scaler and embedding-server controller if asked)."""
        spec, master, job = self.spec, self.master, self.job
        oom = OomPolicy(spec.oom_memory_factor, spec.oom_max_memory_mib)
        # One supervisor relaunches every slot of the job, whichever role's controller asks.
        supervisor = SlotSupervisor(
            job.diagnostics, RelaunchPolicy(spec.max_relaunches, oom), master.store
        )
        delay = self.settings.relaunch_delay_s
        if spec.tf is not None:
            tf_spec = spec.tf
            sizer: Callable[[TfController], TfSizer] | None = None
            worker_scaling: Callable[[TfController], TfWorkerScaler] | None = None
            ps_scaling: Callable[[TfController], TfPsScaler] | None = None
            if scaling is not None:
                from dlrover.master.tf_sizing import TfSizer

                window_s, margin = scaling[0].sizing_window_s, scaling[0].margin
                workers, ps = tf_spec.roles["worker"], tf_spec.roles["ps"]
                cores = float(os.cpu_count() or 1)
                most, interval_s = max(ps.max_count, ps.count), scaling[1]

                def sizer(tf: TfController) -> TfSizer:
                    return TfSizer(job, tf, window_s, margin)

                def ps_scaling(tf: TfController) -> TfPsScaler:
                    return TfPsScaler(job, tf, most, cores, interval_s, time.monotonic)

                if workers.max_count > workers.count:

                    def worker_scaling(tf: TfController) -> TfWorkerScaler:
                        return worker_scaler(job, tf, engine, workers, scaling)

            return TfController(
                job,
                engine,
                spec,
                self.master_addr,
                self.token,
                relaunch_delay_s=delay,
                store=master.store,
                sizer=sizer,
                worker_scaler=worker_scaling,
                ps_scaler=ps_scaling,
                supervisor=supervisor,
            )
        auto_scaler: Callable[[NodeController], AutoScaler] | None = None
        if scaling is not None:
            from dlrover.master.autoscaler import AutoScaler

            config, interval_s, window_s = scaling

            def auto_scaler(controller: NodeController) -> AutoScaler:
                return AutoScaler(job, controller, config, interval_s=interval_s, window_s=window_s)

        ps_controller = None
        if spec.ps is not None:
            from dlrover.master.ps_controller import PsController  # numpy: the ps extra

            ps_controller = PsController(
                job,
                engine,
                spec,
                self.master_addr,
                self.token,
                store=master.store,
                supervisor=supervisor,
            )
        return NodeController(
            job,
            engine,
            spec,
            self.master_addr,
            self.token,
            relaunch_delay_s=delay,
            store=master.store,
            scaler=auto_scaler,
            ps=ps_controller,
            supervisor=supervisor,
        )

    @property
    def running(self) -> bool:
        """Whether the job still runs here: started, not ended, not stopped, not taken over."""
        return (
            self._controller is not None
            and not self._closed
            and not self.job.lifecycle.ended.is_set()
            and not self._stop.is_set()
        )

    def step(self, timeout_s: float = 0.5) -> bool:
        """One iteration of the controller: engine events (waiting up to ``timeout_s`` for
        them), relaunches, scaling. Returns `running`."""
        if self._controller is None:
            raise RuntimeError("JobRunner.start() first")
        if self.running:
            self._controller.step(timeout_s)
        return self.running

    def run(self, poll_s: float = 0.5) -> JobOutcome:
        """Step until the job ends, `stop()` is called or another master takes over; then
        `close()`. Returns the outcome."""
        try:
            while self.step(poll_s):
                pass
        finally:
            self.close()
        return self.outcome()

    def stop(self, reason: str) -> None:
        """End the job (its nodes are stopped, it fails with ``reason``); `run()` returns."""
        if self._master is not None:
            self.job.lifecycle.stop(reason)
        self._stop.set()

    def close(self) -> None:
        """Close the engine (deleting the nodes, unless another master leads the job), stop the
        master and record the job's end. Idempotent."""
        if self._closed or self._controller is None:
            return
        delete_nodes = not self.fenced
        try:
            self._controller.engine.close(delete_nodes=delete_nodes)
        finally:
            self._finish()

    def _finish(self) -> None:
        """Everything after the engine: embedding servers, leftovers, the master, the record."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        try:
            if isinstance(self._controller, NodeController) and self._controller.ps is not None:
                self._controller.ps.close()
            if not self.fenced:
                # Nodes the engine had to SIGKILL (past their grace) could not free their shared
                # memory and temp folders (a TensorFlow ps or worker always ends so); with the
                # local engine they are on this machine.
                sweep_configured(job=self.spec.name)
        finally:
            self._close_master()

    def _close_master(self) -> None:
        master, job = self.master, self.job
        if self.fenced:
            master.store.close()  # another master leads the job: nothing more of it is ours
            return
        final = final_state(job)
        if master.history is not None:
            master.history.sample(job.clock())  # the charts end where the job did
        history = master.history.document() if master.history is not None else None
        master.stop(grace_s=1.0)
        try:
            write_final(self.spec.name, final)
            if history is not None:
                write_history(self.spec.name, history)
        except OSError as e:  # the outcome below matters more than the table
            logger.warning("job %s: cannot write its final state: %s", self.spec.name, e)
        write_record(
            JobRecord(
                name=self.spec.name,
                state=job.lifecycle.state.value,
                pid=os.getpid(),
                reason=job.lifecycle.reason,
                exit_code=job.lifecycle.exit_code,
                engine=self.spec.engine,  # `dlrover logs` of the ended job: where its logs were
                started_at=self._started_at,
                ended_at=time.time(),
            )
        )

    def outcome(self) -> JobOutcome:
        """How the job ended (after `run()`/`close()`, or a `start()` that returned False)."""
        if self._outcome is not None:
            return self._outcome
        if self.fenced:
            newer = self.master.server.fenced_by
            return JobOutcome(
                "fenced", "", EXIT_FENCED, fenced_by=newer.describe() if newer else "?"
            )
        job = self.job
        code = 0 if job.lifecycle.state == JobState.SUCCEEDED else (job.lifecycle.exit_code or 1)
        return JobOutcome(job.lifecycle.state.value, job.lifecycle.reason, code)
