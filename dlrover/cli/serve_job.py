"""Serving one job from the command line: parse, print and exit codes around a `JobRunner`.
Used by `dlrover submit` and `dlrover-master --job-spec`."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence

from dlrover import constants as c
from dlrover.constants import ENV_SUPERVISED, ENV_SUPERVISED_METRICS_PORT
from dlrover.jobspec import JobSpec
from dlrover.master.job import JobMaster
from dlrover.master.server import new_token
from dlrover.runner.job_runner import (
    EXIT_FENCED,
    JobAlreadyRunningError,
    JobRunner,
    JobRunnerError,
    RunnerSettings,
    check_not_running,
)
from dlrover.runner.records import fresh_state

logger = logging.getLogger(__name__)


MAX_MASTER_RESTARTS = 3
"""How many times `dlrover submit` starts its job's master again after it was killed."""

__all__ = [
    "ENV_SUPERVISED",
    "ENV_SUPERVISED_METRICS_PORT",
    "EXIT_FENCED",
    "MAX_MASTER_RESTARTS",
    "free_port",
    "serve_job",
    "supervise_job",
]


def free_port(host: str) -> int:
    """A port free on ``host`` now (for a master that must come back on the same one)."""
    with socket.socket() as s:
        s.bind((host if host != "0.0.0.0" else "", 0))
        return int(s.getsockname()[1])


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
    try:
        check_not_running(spec.name)
    except JobAlreadyRunningError as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 1
    db = fresh_state(spec.name)
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
    """Run `spec` with a `JobRunner` (see `RunnerSettings` for the arguments), saying on the
    terminal what it does, and return the job's exit code.

    ``on_serving`` gets the job once its master serves (a host that is not the main thread, the
    Ray master actor, stops the job through it: signals are handled only on the main thread)."""
    progress_stop = threading.Event()

    def serving(runner: JobRunner) -> None:
        print(
            f"{c.ENV_MASTER_ADDR}={runner.master_addr}\n{c.ENV_JOB_TOKEN}={runner.token}",
            flush=True,
        )
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
            runner.stop(f"dlrover submit received {signal.Signals(signum).name}")

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_signal)
            signal.signal(signal.SIGINT, on_signal)
        if on_serving is not None:
            on_serving(runner.job)

    runner = JobRunner(
        spec,
        RunnerSettings(
            host=host,
            port=port,
            advertise=advertise,
            token=token,
            relaunch_delay_s=relaunch_delay_s,
            state=state,
            metrics_port=metrics_port,
            tensorboard_dir=tensorboard_dir,
        ),
        on_serving=serving,
    )
    try:
        if not runner.start():
            ended = runner.outcome()
            print(
                f"job {spec.name} already {ended.state} ({ended.reason}); nothing to serve",
                file=sys.stderr,
            )
            return 0
    except JobRunnerError as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return e.exit_code
    if spec.tf is None:
        threading.Thread(
            target=_progress_loop, args=(runner.job, progress_stop), daemon=True
        ).start()
    try:
        outcome = runner.run()
    finally:
        progress_stop.set()
    if outcome.state == "fenced":
        print(
            f"job {spec.name}: another master ({outcome.fenced_by}) took over; "
            "this one stopped without touching the job's nodes or record",
            file=sys.stderr,
        )
    else:
        print(f"job {spec.name} {outcome.state}: {outcome.reason}", file=sys.stderr)
    return outcome.exit_code


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
