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
from pathlib import Path

from dlrover import constants as c
from dlrover.constants import ENV_SUPERVISED, ENV_SUPERVISED_METRICS_PORT
from dlrover.jobspec import JobSpec
from dlrover.master.server import new_token
from dlrover.runner.job_runner import EXIT_FENCED, JobAlreadyRunningError, check_not_running
from dlrover.runner.records import NoSuchJobError, fresh_state, read_record
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


def _recorded_ports(name: str, pid: int, port: int, metrics_port: int, db: Path) -> dict[str, str]:
    """The ports the master ``pid`` served job ``name`` on, from the record it wrote, for its
    successor; the given ones where it wrote none (it died before serving: no node knows it)."""
    try:
        record = read_record(name)
    except NoSuchJobError:
        record = None
    if record is not None and record.pid == pid and record.master_addr:
        port = int(record.master_addr.rsplit(":", 1)[1])
        metrics_port = record.web_port or metrics_port
    return {ENV_SUPERVISED: f"{port}:{db}", ENV_SUPERVISED_METRICS_PORT: str(metrics_port)}


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
    # Without --port the first master binds a free port itself (a port picked here could be
    # taken before it binds: an outgoing connection may get it as its local port, seen in CI),
    # and a restarted one comes back on the ports the first one recorded: the nodes know them.
    env = {
        **os.environ,
        ENV_SUPERVISED: f"{port}:{db}",
        ENV_SUPERVISED_METRICS_PORT: str(metrics_port),
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
        env.update(_recorded_ports(spec.name, child.pid, port, metrics_port, db))
        print(
            f"dlrover: the master of job {spec.name} (pid {child.pid}) was killed by {how}; "
            f"starting it again on its state ({restarts}/{MAX_MASTER_RESTARTS})",
            file=sys.stderr,
            flush=True,
        )
