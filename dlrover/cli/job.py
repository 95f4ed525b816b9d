"""`dlrover submit | status | stop`: run a whole job through an engine, inspect it, end it."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dlrover import constants as c
from dlrover.cli.common import setup_logging
from dlrover.client.master_client import MasterClient, MasterClientError
from dlrover.engines.base import Engine
from dlrover.jobspec import JobSpec, JobSpecError, job_spec_from_flags, load_job_spec
from dlrover.master.job import JobMaster, JobMasterConfig, JobState
from dlrover.master.node_controller import NodeController
from dlrover.master.rendezvous import RendezvousConfig
from dlrover.master.server import MasterServer, MasterServerError, new_token
from dlrover.master.state_store import SqliteStateStore
from dlrover.proto import master_pb2 as pb

logger = logging.getLogger("dlrover.job")


def dlrover_home() -> Path:
    """Where job records live: $DLROVER_HOME, else ~/.dlrover."""
    return Path(os.environ.get("DLROVER_HOME", "") or Path.home() / ".dlrover")


def _record_path(name: str) -> Path:
    return dlrover_home() / "jobs" / name / "job.json"


def _write_record(name: str, record: dict[str, Any]) -> None:
    path = _record_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


def _read_record(name: str) -> dict[str, Any]:
    path = _record_path(name)
    if not path.exists():
        raise SystemExit(f"dlrover: error: no job named {name!r} (looked in {path.parent})")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def make_engine(spec: JobSpec, job_dir: Path) -> Engine:
    """The engine the job spec names; optional packages are imported only when asked for."""
    settings = dict(spec.engine_settings)
    if spec.engine == "local":
        from dlrover.engines.local import LocalEngine

        return LocalEngine(job_dir / "nodes")
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


def serve_job(
    spec: JobSpec,
    host: str = "0.0.0.0",
    port: int = 0,
    advertise: str = "",
    token: str = "",
    relaunch_delay_s: float = 0.0,
) -> int:
    """Run the master of `spec`, launch its nodes through its engine, return the job's exit code."""
    job_dir = dlrover_home() / "jobs" / spec.name
    record = _record_path(spec.name)
    if record.exists():
        old = json.loads(record.read_text())
        if old.get("state") not in ("succeeded", "failed") and _pid_alive(int(old.get("pid", 0))):
            print(
                f"dlrover: error: job {spec.name!r} is already running (pid {old['pid']}); "
                f"`dlrover stop {spec.name}` first, or give the job another name",
                file=sys.stderr,
            )
            return 1
    job_dir.mkdir(parents=True, exist_ok=True)
    db = job_dir / "master.db"
    for stale in (db, db.with_name("master.db-wal"), db.with_name("master.db-shm")):
        stale.unlink(missing_ok=True)  # a new submission starts from a clean state
    token = token or os.environ.get(c.ENV_JOB_TOKEN, "") or new_token()
    store = SqliteStateStore(str(db))
    job = JobMaster(
        JobMasterConfig(
            job_name=spec.name,
            rendezvous=RendezvousConfig(spec.min_nodes, spec.max_nodes),
        ),
        store,
    )
    try:
        server = MasterServer(job, token, host=host, port=port).start()
    except MasterServerError as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 1
    master_addr = _advertise(spec, server.port, advertise)
    _write_record(
        spec.name,
        {
            "name": spec.name,
            "master_addr": master_addr,
            "token": token,
            "pid": os.getpid(),
            "engine": spec.engine,
            "state": "running",
        },
    )
    print(f"{c.ENV_MASTER_ADDR}={master_addr}\n{c.ENV_JOB_TOKEN}={token}", flush=True)
    print(
        f"job {spec.name}: {spec.nnodes} nodes x {spec.nproc_per_node} workers on engine "
        f"{spec.engine}; `dlrover status {spec.name}` to follow it",
        file=sys.stderr,
        flush=True,
    )

    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        job.stop(f"dlrover submit received {signal.Signals(signum).name}")
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        engine = make_engine(spec, job_dir)
    except Exception as e:  # an engine that cannot start is the job's failure, said plainly
        job.stop(f"cannot start engine {spec.engine}: {e}")
        print(f"dlrover: error: cannot start engine {spec.engine}: {e}", file=sys.stderr)
        server.stop(0.5)
        _write_record(spec.name, {"name": spec.name, "state": "failed", "pid": os.getpid()})
        return 1
    controller = NodeController(
        job, engine, spec, master_addr, token, relaunch_delay_s=relaunch_delay_s
    )
    progress = threading.Thread(target=_progress_loop, args=(job, stop), daemon=True)
    progress.start()
    try:
        controller.start()
        controller.run(stop)
    finally:
        stop.set()
        server.stop(grace_s=1.0)
        store.close()
        _write_record(
            spec.name,
            {
                "name": spec.name,
                "state": job.state.value,
                "reason": job.reason,
                "exit_code": job.exit_code,
                "pid": os.getpid(),
            },
        )
    print(f"job {spec.name} {job.state.value}: {job.reason}", file=sys.stderr)
    return 0 if job.state == JobState.SUCCEEDED else (job.exit_code or 1)


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


def _status_table(status: pb.JobStatus) -> str:
    lines = [
        f"job {status.job_name}: {status.state} (round {status.round})"
        + (f" - {status.reason}" if status.reason else "")
    ]
    lines.append(
        f"{'node':<28} {'rank':>4} {'state':<10} {'step':>8} {'restarts':>8} {'cpu%':>6} {'mem MB':>8}"
    )
    for n in sorted(status.nodes, key=lambda n: (n.node_rank, n.node_id)):
        lines.append(
            f"{n.node_id:<28} {n.node_rank:>4} {n.state:<10} {n.step:>8} "
            f"{n.restart_count:>8} {n.cpu_percent:>6.0f} {n.memory_bytes / 2**20:>8.0f}"
        )
    return "\n".join(lines)


def cmd_status(name: str) -> int:
    record = _read_record(name)
    if record.get("state") in ("succeeded", "failed") or "master_addr" not in record:
        print(f"job {name}: {record.get('state')} - {record.get('reason', '')}")
        return 0
    client = MasterClient(record["master_addr"], record["token"], rpc_timeout_s=5)
    try:
        print(_status_table(client.get_job_status()))
    except MasterClientError as e:
        print(f"dlrover: error: job {name}'s master does not answer: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


def cmd_stop(name: str, timeout_s: float = 60.0) -> int:
    record = _read_record(name)
    if record.get("state") in ("succeeded", "failed") or "master_addr" not in record:
        print(f"job {name} already ended: {record.get('state')}")
        return 0
    client = MasterClient(record["master_addr"], record["token"], rpc_timeout_s=5)
    try:
        client.stop_job("stopped by dlrover stop")
    except MasterClientError as e:
        print(f"dlrover: error: cannot reach job {name}'s master: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    deadline = time.monotonic() + timeout_s
    pid = int(record.get("pid", 0))

    def ended() -> bool:
        # The submitter writes the final state last; a dead pid covers a submitter that crashed.
        return _read_record(name).get("state") in ("succeeded", "failed") or not _pid_alive(pid)

    while not ended() and time.monotonic() < deadline:
        time.sleep(0.1)
    if not ended():
        print(
            f"dlrover: job {name} did not stop within {timeout_s:.0f}s (pid {pid})", file=sys.stderr
        )
        return 1
    print(f"job {name} stopped")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dlrover", description="Submit, inspect and stop DLRover jobs."
    )
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("submit", help="Run a job: a YAML job spec, or flags and an entry point.")
    s.add_argument(
        "spec_or_entrypoint", help="job.yaml, or the training script when flags describe the job"
    )
    s.add_argument("args", nargs=argparse.REMAINDER, help="Arguments of the training script.")
    s.add_argument("--engine", default="local", help="local (default), ray or kubernetes")
    s.add_argument("--nnodes", default="1", help="N or MIN:MAX")
    s.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1)
    s.add_argument("--name", default=None, help="Job name (default: from the entry point)")
    s.add_argument("--max-restarts", "--max_restarts", type=int, default=3)
    s.add_argument("--cpu", type=float, default=0.0)
    s.add_argument("--memory", default="0", help="Per node, e.g. 8Gi")
    s.add_argument("--gpu", type=int, default=0)
    s.add_argument("--port", type=int, default=0, help="The master's port (0: a free one)")
    s.add_argument(
        "--advertise-address", default="", help="host[:port] nodes use to reach the master"
    )
    s.add_argument(
        "--relaunch-delay",
        type=float,
        default=0.0,
        help="Seconds to wait before replacing a lost node (back-off; default 0)",
    )
    st = sub.add_parser("status", help="Nodes, states, restarts, step of a job.")
    st.add_argument("name")
    sp = sub.add_parser("stop", help="End a job: workers stop, nodes are removed.")
    sp.add_argument("name")
    sp.add_argument("--timeout", type=float, default=60.0)
    return p


def run(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "status":
        return cmd_status(args.name)
    if args.command == "stop":
        return cmd_stop(args.name, args.timeout)
    try:
        target = args.spec_or_entrypoint
        if target.endswith((".yaml", ".yml")):
            spec = load_job_spec(target)
        else:
            spec = job_spec_from_flags(
                target,
                args.args,
                nnodes=args.nnodes,
                nproc_per_node=args.nproc_per_node,
                engine=args.engine,
                name=args.name,
                cpu=args.cpu,
                memory=args.memory,
                gpu=args.gpu,
                max_restarts=args.max_restarts,
            )
    except (JobSpecError, OSError) as e:
        parser.error(str(e))
    setup_logging("dlrover")
    return serve_job(
        spec, port=args.port, advertise=args.advertise_address, relaunch_delay_s=args.relaunch_delay
    )


def main() -> None:
    sys.exit(run())


if __name__ == "__main__":
    main()
