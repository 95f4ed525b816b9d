"""`dlrover submit`'s supervision: the job's master runs in a child process that is started again
when it is killed. The serving itself (`serve_job`) is `dlrover.runner.serve`."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence

from dlrover import constants as c
from dlrover.constants import ENV_SUPERVISED, ENV_SUPERVISED_METRICS_PORT
from dlrover.jobspec import JobSpec
from dlrover.master.server import new_token
from dlrover.runner.job_runner import EXIT_FENCED, JobAlreadyRunningError, check_not_running
from dlrover.runner.records import fresh_state
from dlrover.runner.serve import serve_job

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
