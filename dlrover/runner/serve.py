"""Serving one job in this process with its console: a `JobRunner` that says on the terminal
what it does (the master's address and token, the job's shape, progress every 5 s, the outcome)
and returns the job's exit code. `dlrover submit`'s master child, `dlrover-master --job-spec`
and the Ray master actor (`dlrover.runner.ray_master`) all serve a job so."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable

from dlrover import constants as c
from dlrover.jobspec import JobSpec
from dlrover.master.job import JobMaster
from dlrover.runner.job_runner import JobRunner, JobRunnerError, RunnerSettings

__all__ = ["serve_job"]


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
    heartbeat_port: int | None = 0,
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
            heartbeat_port=heartbeat_port,
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
        nodes = job.members.nodes.all()
        running = sum(1 for n in nodes if n.state.value == "running")
        step = max((n.step for n in nodes), default=-1)
        round_ = job.rendezvous.round if job.rendezvous else 0
        print(
            f"job {job.config.job_name}: {job.lifecycle.state.value}, round {round_}, "
            f"{running}/{len(nodes)} nodes running, step {step}",
            file=sys.stderr,
            flush=True,
        )
