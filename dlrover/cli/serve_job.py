"""Serving one job: its master (built by `build_master`), its nodes through an engine, its
record, until it ends. Used by `dlrover submit` and `dlrover-master --job-spec`."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from dlrover import constants as c
from dlrover.checkpoint.leftovers import sweep
from dlrover.cli.job_records import (
    JobRecord,
    has_record,
    job_dir,
    pid_alive,
    read_record,
    write_record,
)
from dlrover.engines.base import Engine
from dlrover.envvars import number_from_env
from dlrover.jobspec import JobSpec, JobSpecError, parse_capacity
from dlrover.master.assembly import MasterSettings, RunningMaster, build_master
from dlrover.master.job import JobMaster, JobState
from dlrover.master.node_controller import NodeController
from dlrover.master.optimizer import OptimizerConfig
from dlrover.master.relaunch_policy import OomPolicy
from dlrover.master.rendezvous import RendezvousConfig
from dlrover.master.server import MasterServerError, new_token
from dlrover.master.state_store import StateStoreError
from dlrover.master.stragglers import DEFAULT_REPORT_S
from dlrover.master.tensorboard import TensorBoardError
from dlrover.master.web import WebError

logger = logging.getLogger(__name__)

ENV_SUPERVISED_METRICS_PORT = "DLROVER_SUPERVISED_METRICS_PORT"
"""The metrics port a supervised `dlrover submit` child serves on (picked by its supervisor)."""


def env_seconds(name: str, default: float) -> float:
    """A duration from the environment variable ``name`` (unset or empty: ``default``)."""
    try:
        return number_from_env(name, default, f"a number of seconds (e.g. {default:g})")
    except ValueError as e:
        raise JobSpecError(str(e)) from None


def _autoscale_settings(spec: JobSpec) -> tuple[OptimizerConfig, float, float] | None:
    """The auto-scaler's policy knobs, interval and rate window (environment), or None without
    --auto-scale."""
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


def make_engine(spec: JobSpec, job_dir: Path) -> Engine:
    """The engine the job spec names; optional packages are imported only when asked for."""
    settings = dict(spec.engine_settings)
    if spec.engine == "local":
        from dlrover.engines.local import LocalEngine

        capacity = parse_capacity(str(settings.get("capacity", "")))
        return LocalEngine(job_dir / "nodes", capacity=capacity)
    if spec.engine == "ray":
        from dlrover.engines.ray_engine import RayEngine

        return RayEngine(address=settings.get("address"))
    from dlrover.engines.kube_manifests import PodSettings
    from dlrover.engines.kubernetes_engine import KubernetesEngine

    if "image" not in settings:
        raise JobSpecError("engine kubernetes needs engine_settings.image (the container image)")
    return KubernetesEngine.from_environment(
        spec.name,
        PodSettings(
            image=str(settings["image"]),
            namespace=str(settings.get("namespace", "default")),
            service_account=str(settings.get("service_account", "")),
        ),
    )


def _advertise(spec: JobSpec, port: int, explicit: str) -> str:
    if explicit:
        return explicit if ":" in explicit else f"{explicit}:{port}"
    if spec.engine == "local":
        return f"127.0.0.1:{port}"
    try:
        return f"{socket.gethostbyname(socket.gethostname())}:{port}"
    except OSError:
        return f"{socket.getfqdn()}:{port}"


ENV_SUPERVISED = "_DLROVER_SUPERVISED_MASTER"
"""Set by `supervise_job` for its child: ``<port>:<state path>`` (the child serves the job on
them; a restarted child resumes from the state)."""

EXIT_FENCED = 3
"""Exit code of a master that another master took its job's state from."""

MAX_MASTER_RESTARTS = 3
"""How many times `dlrover submit` starts its job's master again after it was killed."""


def _already_running(name: str) -> bool:
    if not has_record(name):
        return False
    old = read_record(name)
    # (A restarted container may reuse the old pid: that is us, not another master.)
    if not old.ended and old.pid != os.getpid() and pid_alive(old.pid):
        print(
            f"dlrover: error: job {name!r} is already running (pid {old.pid}); "
            f"`dlrover stop {name}` first, or give the job another name",
            file=sys.stderr,
        )
        return True
    return False


def free_port(host: str) -> int:
    """A port free on ``host`` now (for a master that must come back on the same one)."""
    with socket.socket() as s:
        s.bind((host if host != "0.0.0.0" else "", 0))
        return int(s.getsockname()[1])


def _local_logs(directory: Path) -> Callable[[str, int], str | None]:
    """Reads the tail of a local-engine node's log (its stderr file) for the dashboard."""

    def tail(node_id: str, lines: int) -> str | None:
        path = directory / "nodes" / node_id / "stderr"
        if "/" in node_id or node_id in ("", ".", "..") or not path.is_file():
            return None
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - (256 << 10)))
            text = f.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    return tail


def supervise_job(
    spec: JobSpec,
    argv: Sequence[str],
    host: str = "0.0.0.0",
    port: int = 0,
    metrics_port: int = 0,
) -> int:
    """`dlrover submit`: serve the job from a child process (``argv`` again, with
    ENV_SUPERVISED set), and start the child again, on the same port, token and state, when it
    is killed (SIGKILL, OOM): the job's nodes keep running, the new master resumes the job and
    adopts them. A child that exits (the job ended, or an error) ends the submission with its
    code; SIGTERM/SIGINT are passed on to it (it stops the job)."""
    if _already_running(spec.name):
        return 1
    directory = job_dir(spec.name)
    directory.mkdir(parents=True, exist_ok=True)
    db = directory / "master.db"
    for stale in (db, db.with_name("master.db-wal"), db.with_name("master.db-shm")):
        stale.unlink(missing_ok=True)  # a new submission starts from a clean state
    env = {
        **os.environ,
        ENV_SUPERVISED: f"{port or free_port(host)}:{db}",
        # The same dashboard address across master restarts.
        ENV_SUPERVISED_METRICS_PORT: str(metrics_port or free_port(host)),
        c.ENV_JOB_TOKEN: os.environ.get(c.ENV_JOB_TOKEN, "") or new_token(),
    }
    stopping = threading.Event()
    child: subprocess.Popen[bytes] | None = None

    def forward(signum: int, frame: object) -> None:
        stopping.set()
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    restarts = 0
    while True:
        child = subprocess.Popen([sys.executable, "-m", "dlrover.cli.job", *argv], env=env)
        code = child.wait()  # the job's whole life: the master itself bounds it
        if code >= 0 or stopping.is_set():
            return code if code >= 0 else 1
        how = signal.Signals(-code).name
        if restarts >= MAX_MASTER_RESTARTS:
            print(
                f"dlrover: error: the master of job {spec.name} was killed by {how} "
                f"{restarts + 1} times; giving up (its nodes are stopped by `dlrover stop "
                f"{spec.name}`)",
                file=sys.stderr,
            )
            return 1
        restarts += 1
        print(
            f"dlrover: the master of job {spec.name} (pid {child.pid}) was killed by {how}; "
            f"starting it again on its state ({restarts}/{MAX_MASTER_RESTARTS})",
            file=sys.stderr,
            flush=True,
        )


def serve_job(
    spec: JobSpec,
    host: str = "0.0.0.0",
    port: int = 0,
    advertise: str = "",
    token: str = "",
    relaunch_delay_s: float = 0.0,
    state: str = "",
    on_serving: Callable[[JobMaster], None] | None = None,
    metrics_port: int | None = 0,
    tensorboard_dir: str = "",
) -> int:
    """Run the master of `spec`, launch its nodes through its engine, return the job's exit code.

    ``state``: the master's state (a SQLite path or redis://...). When it holds this job already
    (a master container restarted on its volume), the job resumes: nodes, round, commits, and
    each slot's node attempt, which the engine adopts where it still runs. Empty: a fresh state
    in the job's directory (what `dlrover submit` does).

    ``metrics_port``: where /metrics and the dashboard are served (0: a free port; None:
    nowhere); ``tensorboard_dir``: also write metrics as TensorBoard events there.
    ``on_serving`` gets the job once its master serves (a host that is not the main thread, the
    Ray master actor, stops the job through it: signals are handled only on the main thread)."""
    try:
        scaling = _autoscale_settings(spec)
    except JobSpecError as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 2
    directory = job_dir(spec.name)
    if _already_running(spec.name):
        return 1
    directory.mkdir(parents=True, exist_ok=True)
    db = directory / "master.db"
    if not state:
        for stale in (db, db.with_name("master.db-wal"), db.with_name("master.db-shm")):
            stale.unlink(missing_ok=True)  # a new submission starts from a clean state
    token = token or os.environ.get(c.ENV_JOB_TOKEN, "") or new_token()
    stop = threading.Event()
    try:
        master = build_master(
            MasterSettings(
                job_name=spec.name,
                token=token,
                host=host,
                port=port,
                state=state or str(db),
                rendezvous=RendezvousConfig(spec.min_nodes, spec.max_nodes),
                owns_process=True,
                exclude_stragglers=spec.exclude_straggler,
                straggler_report_s=float(
                    os.environ.get(c.ENV_STRAGGLER_REPORT_S, "") or DEFAULT_REPORT_S
                ),
                metrics_port=metrics_port,
                tensorboard_dir=tensorboard_dir,
                log_reader=_local_logs(directory) if spec.engine == "local" else None,
            ),
            on_fenced=lambda newer: stop.set(),
        )
    except (MasterServerError, WebError, TensorBoardError, StateStoreError) as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 1
    job = master.job
    if job.ended.is_set():
        # A master restarted after the job's end (its container's OnFailure restart after a
        # failed job): the run that ended it reported the outcome; do not loop on it.
        print(
            f"job {spec.name} already {job.state.value} ({job.reason}); nothing to serve",
            file=sys.stderr,
        )
        master.stop(0.5)
        return 0
    master_addr = _advertise(spec, master.port, advertise)
    if master.web is not None:
        logger.info(
            "job %s: metrics and dashboard on http://%s:%d/",
            spec.name,
            master_addr.rsplit(":", 1)[0],
            master.web.port,
        )
    write_record(
        JobRecord(
            name=spec.name,
            state="running",
            pid=os.getpid(),
            master_addr=master_addr,
            token=token,
            engine=spec.engine,
        )
    )
    print(f"{c.ENV_MASTER_ADDR}={master_addr}\n{c.ENV_JOB_TOKEN}={token}", flush=True)
    shape = (
        ", ".join(f"{spec.tf.count(r)} {r}" for r in spec.tf.roles)
        if spec.tf is not None
        else f"{spec.nnodes} nodes x {spec.nproc_per_node} workers"
    )
    print(
        f"job {spec.name}: {shape} on engine {spec.engine}; `dlrover status {spec.name}` to "
        "follow it",
        file=sys.stderr,
        flush=True,
    )

    def on_signal(signum: int, frame: object) -> None:
        job.stop(f"dlrover submit received {signal.Signals(signum).name}")
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
    if on_serving is not None:
        on_serving(job)
    try:
        engine = make_engine(spec, directory)
    except Exception as e:  # an engine that cannot start is the job's failure, said plainly
        job.stop(f"cannot start engine {spec.engine}: {e}")
        print(f"dlrover: error: cannot start engine {spec.engine}: {e}", file=sys.stderr)
        master.stop(0.5)
        write_record(JobRecord(name=spec.name, state="failed", pid=os.getpid()))
        return 1
    if spec.tf is not None:
        return _serve_tf_job(spec, master, job, engine, master_addr, token, relaunch_delay_s, stop)
    controller = NodeController(
        job,
        engine,
        spec,
        master_addr,
        token,
        relaunch_delay_s=relaunch_delay_s,
        store=master.store,
        oom_policy=OomPolicy(spec.oom_memory_factor, spec.oom_max_memory_mib),
    )
    if scaling is not None:
        from dlrover.master.autoscaler import AutoScaler

        controller.scaler = AutoScaler(
            job, controller, scaling[0], interval_s=scaling[1], window_s=scaling[2]
        )
    if spec.ps is not None:
        from dlrover.master.ps_controller import PsController

        controller.ps = PsController(
            job,
            engine,
            spec,
            master_addr,
            token,
            oom_policy=OomPolicy(spec.oom_memory_factor, spec.oom_max_memory_mib),
            store=master.store,
        )
        job.ps = controller.ps
    progress = threading.Thread(target=_progress_loop, args=(job, stop), daemon=True)
    progress.start()
    fenced = master.server.fenced
    try:
        if controller.ps is not None:
            controller.ps.start()  # the workers wait for the servers' placement
        controller.start()
        controller.run(stop, delete_nodes=lambda: not fenced.is_set())
    finally:
        stop.set()
        if controller.ps is not None:
            controller.ps.close()
        if not fenced.is_set():
            # Nodes the engine had to SIGKILL (past their grace) could not free their shared
            # memory and temp folders; with the local engine they are on this machine.
            sweep(job=spec.name)
        _close_master(spec, master, job)
    return _outcome(spec, master, job)


def _close_master(spec: JobSpec, master: RunningMaster, job: JobMaster) -> None:
    """Stop the master and record the job's end, unless another master took the job over."""
    if master.server.fenced.is_set():
        master.store.close()  # another master leads the job: nothing more of it is ours
        return
    master.stop(grace_s=1.0)
    write_record(
        JobRecord(
            name=spec.name,
            state=job.state.value,
            pid=os.getpid(),
            reason=job.reason,
            exit_code=job.exit_code,
        )
    )


def _outcome(spec: JobSpec, master: RunningMaster, job: JobMaster) -> int:
    """Say how the job ended; its exit code (EXIT_FENCED when another master took over)."""
    if master.server.fenced.is_set():
        newer = master.server.fenced_by
        print(
            f"job {spec.name}: another master ({newer.describe() if newer else '?'}) took over; "
            "this one stopped without touching the job's nodes or record",
            file=sys.stderr,
        )
        return EXIT_FENCED
    print(f"job {spec.name} {job.state.value}: {job.reason}", file=sys.stderr)
    return 0 if job.state == JobState.SUCCEEDED else (job.exit_code or 1)


def _serve_tf_job(
    spec: JobSpec,
    master: RunningMaster,
    job: JobMaster,
    engine: Engine,
    master_addr: str,
    token: str,
    relaunch_delay_s: float,
    stop: threading.Event,
) -> int:
    """The rest of `serve_job` for a TensorFlow parameter-server job: its nodes are driven by a
    TfController (cluster spec, relaunches); the job ends with its chief."""
    from dlrover.master.tf_controller import TfController

    controller = TfController(
        job,
        engine,
        spec,
        master_addr,
        token,
        oom_policy=OomPolicy(spec.oom_memory_factor, spec.oom_max_memory_mib),
        relaunch_delay_s=relaunch_delay_s,
        store=master.store,
    )
    job.tf = controller
    fenced = master.server.fenced
    try:
        controller.start()
        controller.run(stop, delete_nodes=lambda: not fenced.is_set())
    finally:
        stop.set()
        _close_master(spec, master, job)
    return _outcome(spec, master, job)


def _progress_loop(job: JobMaster, stop: threading.Event, every_s: float = 5.0) -> None:
    while not stop.wait(every_s):
        nodes = job.nodes.all()
        running = sum(1 for n in nodes if n.state.value == "running")
        step = max((n.step for n in nodes), default=-1)
        round_ = job.rendezvous.round if job.rendezvous else 0
        print(
            f"job {job.config.job_name}: {job.state.value}, round {round_}, "
            f"{running}/{len(nodes)} nodes running, step {step}",
            file=sys.stderr,
            flush=True,
        )
