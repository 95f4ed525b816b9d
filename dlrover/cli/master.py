"""`dlrover-master`: the job master as its own process, for jobs of several nodes."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from dlrover import constants as c
from dlrover.cli.common import parse_nnodes, setup_logging
from dlrover.master.assembly import MasterSettings, build_master
from dlrover.master.job import JobState
from dlrover.master.rendezvous import RendezvousConfig, RendezvousError
from dlrover.master.server import MasterServerError, job_name_for_token, new_token
from dlrover.master.state_store import StateStoreError
from dlrover.master.tensorboard import TensorBoardError
from dlrover.master.web import WebError
from dlrover.runner.job_runner import straggler_report_s

logger = logging.getLogger("dlrover.master")

EXIT_FENCED = 3
"""dlrover-master's exit code when another master took over its job's state."""


def build_parser() -> argparse.ArgumentParser:
    """The ``dlrover-master`` command line."""
    p = argparse.ArgumentParser(
        prog="dlrover-master",
        description="Run the DLRover job master. Prints DLROVER_MASTER_ADDR and DLROVER_JOB_TOKEN; "
        "start each node with those in its environment: dlrover-run --nnodes=N ... train.py",
    )
    p.add_argument(
        "--port", type=int, default=0, help="Port to listen on; 0 picks a free one (default)."
    )
    p.add_argument(
        "--heartbeat-port",
        type=int,
        default=0,
        help="Port of the server that answers heartbeats alone, so that a burst of other calls "
        "never holds them up; the nodes are told it in every heartbeat reply (default 0: a free "
        "one; -1: none, heartbeats come to --port).",
    )
    p.add_argument("--host", default="0.0.0.0", help="Address to listen on (default all).")
    p.add_argument(
        "--advertise-addr",
        "--advertise-address",
        default="",
        help="host or host:port the nodes use to reach the master (default: this host's IP).",
    )
    p.add_argument(
        "--job-spec",
        default="",
        metavar="FILE",
        help="A YAML job spec: the master then launches and replaces the job's nodes through the "
        "spec's engine (what `dlrover submit` does).",
    )
    p.add_argument(
        "--token",
        default=None,
        help=f"The job token (default: ${c.ENV_JOB_TOKEN}, else a random one).",
    )
    p.add_argument(
        "--write-env",
        default="",
        metavar="FILE",
        help="Also write the DLROVER_MASTER_ADDR/DLROVER_JOB_TOKEN lines to FILE.",
    )
    p.add_argument(
        "--nnodes", default="", help="MIN:MAX nodes; by default the first node's --nnodes decides."
    )
    p.add_argument(
        "--node-unit", type=int, default=1, help="Nodes join and leave in multiples of this."
    )
    p.add_argument(
        "--job-name",
        default="",
        help="The job's name (the workers' TORCHELASTIC_RUN_ID); default: derived from the token.",
    )
    p.add_argument(
        "--state-db",
        default="",
        help="The master's durable state: a SQLite file (default: a new file in a temp dir, removed "
        "when the master ends; "
        "with --job-spec a fresh one in the job's directory, while a given state that holds the job "
        "resumes it), "
        "redis://host:port[/db][?prefix=JOB] (a Redis server, so a master on another machine "
        "can take over; pip install 'dlrover[redis]'), or 'memory'. Give the same state to "
        "resume after a restart.",
    )
    p.add_argument(
        "--tensorboard-dir",
        default="",
        help="Also write the job's metrics (goodput, badput, steps, nodes) as TensorBoard event "
        "files here, every 10 s.",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="Port of /metrics (Prometheus) and the dashboard (default 0: a free one, printed; "
        "-1: none).",
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=c.DEFAULT_HEARTBEAT_TIMEOUT_S,
        help="Seconds without a heartbeat before a node counts as lost.",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=c.DEFAULT_MASTER_IDLE_TIMEOUT_S,
        help="Exit with an error if no node registers within this many seconds.",
    )
    p.add_argument(
        "--last-call-timeout",
        type=float,
        default=c.DEFAULT_RDZV_LAST_CALL_TIMEOUT_S,
        help="Seconds to wait for more nodes once MIN are present.",
    )
    return p


def _advertise_host(args: argparse.Namespace) -> str:
    if args.advertise_addr:
        return str(args.advertise_addr)
    if args.host not in ("0.0.0.0", "::", ""):
        return str(args.host)
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def run(argv: Sequence[str] | None = None) -> int:
    """Run ``dlrover-master``. With --job-spec, serve a whole job through its engine; otherwise
    start a master, print DLROVER_MASTER_ADDR and DLROVER_JOB_TOKEN, and serve until the job ends, a
    SIGTERM or SIGINT stops it, or no node registers within --idle-timeout. Returns 0 if the job
    succeeded, else its exit code (at least 1); 3 if another master took over its state."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.job_spec:
        from dlrover.cli.serve_job import serve_job
        from dlrover.jobspec import JobSpecError, load_job_spec

        try:
            spec = load_job_spec(args.job_spec)
        except (JobSpecError, OSError) as e:
            parser.error(str(e))
        setup_logging("dlrover-master")
        return serve_job(
            spec,
            args.host,
            args.port,
            args.advertise_addr,
            args.token or "",
            state=args.state_db or "",
            heartbeat_port=None if args.heartbeat_port < 0 else args.heartbeat_port,
        )
    rdzv = None
    try:
        if args.nnodes:
            lo, hi = parse_nnodes(args.nnodes)
            rdzv = RendezvousConfig(lo, hi, args.node_unit, args.last_call_timeout)
            rdzv.validate()
    except (ValueError, RendezvousError) as e:
        parser.error(str(e))
    setup_logging("dlrover-master")
    token = args.token or os.environ.get(c.ENV_JOB_TOKEN) or new_token()
    job_name = args.job_name or job_name_for_token(token)
    # Without --state-db the state lives in a folder of its own, removed when the master ends
    # (nothing can resume from it: a restart without --state-db starts a new one).
    scratch = "" if args.state_db else tempfile.mkdtemp(prefix="dlrover_master_")
    db = args.state_db or os.path.join(scratch, "state.db")
    try:
        return _serve(args, token, job_name, db, rdzv)
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def _serve(
    args: argparse.Namespace, token: str, job_name: str, db: str, rdzv: RendezvousConfig | None
) -> int:
    """Serve the job until it ends (the body of ``run`` without --job-spec)."""
    try:
        master = build_master(
            MasterSettings(
                job_name=job_name,
                token=token,
                host=args.host,
                port=args.port,
                heartbeat_port=None if args.heartbeat_port < 0 else args.heartbeat_port,
                state=db,
                rendezvous=rdzv,
                heartbeat_timeout_s=args.heartbeat_timeout,
                metrics_port=None if args.metrics_port < 0 else args.metrics_port,
                tensorboard_dir=args.tensorboard_dir,
                owns_process=True,
                straggler_report_s=straggler_report_s(),
            )
        )
    except (MasterServerError, WebError, TensorBoardError, StateStoreError, RendezvousError) as e:
        print(f"dlrover-master: error: {e}", file=sys.stderr)
        return 1

    host = _advertise_host(args)
    job = master.job
    addr = host if ":" in host else f"{host}:{master.port}"
    lines = f"{c.ENV_MASTER_ADDR}={addr}\n{c.ENV_JOB_TOKEN}={token}\n"
    if args.write_env:
        tmp = args.write_env + ".tmp"
        with open(tmp, "w") as f:
            f.write(lines)
        os.replace(tmp, args.write_env)
    sys.stdout.write(lines)
    sys.stdout.flush()
    logger.info("state in %s", db)
    if master.web is not None:
        logger.info("metrics and dashboard: http://%s:%d/", host.rsplit(":", 1)[0], master.web.port)

    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        job.lifecycle.stop(f"master received {signal.Signals(signum).name}")
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    start = time.monotonic()
    while not job.lifecycle.ended.wait(0.5):
        if master.server.fenced.is_set():
            newer = master.server.fenced_by
            print(
                f"dlrover-master: another master ({newer.describe() if newer else '?'}) took over "
                f"job {job_name}; this one stopped without touching the job",
                file=sys.stderr,
            )
            master.store.close()
            return EXIT_FENCED
        if len(job.members.nodes) == 0 and time.monotonic() - start > args.idle_timeout:
            job.lifecycle.stop(f"no node registered within {args.idle_timeout:.0f}s")
    # Let agents still in their exit barrier read the final state before the server goes away.
    if not stop.is_set():
        time.sleep(min(2.0, c.DEFAULT_HEARTBEAT_INTERVAL_S))
    master.stop(grace_s=1.0)
    print(
        f"dlrover-master: job {job_name} {job.lifecycle.state.value}: {job.lifecycle.reason}",
        file=sys.stderr,
    )
    return 0 if job.lifecycle.state == JobState.SUCCEEDED else (job.lifecycle.exit_code or 1)


def main() -> None:
    """Console entry point of ``dlrover-master``: exits with ``run()``'s code."""
    sys.exit(run())


if __name__ == "__main__":
    main()
