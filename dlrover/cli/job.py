"""`dlrover submit | status | logs | diagnose | stop | scale`: run a whole job through an engine,
inspect it, read its logs and failures, end it, change its embedding servers."""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence

from dlrover.api.errors import MasterUnreachableError
from dlrover.api.master import FailureRecord
from dlrover.cli.common import setup_logging
from dlrover.cli.dashboard import add_parsers as add_dashboard_parsers
from dlrover.cli.dashboard import run_command as run_dashboard_command
from dlrover.cli.job_records import NoSuchJobError, pid_alive, read_record
from dlrover.cli.logs import cmd_logs
from dlrover.cli.serve_job import (
    ENV_SUPERVISED,
    ENV_SUPERVISED_METRICS_PORT,
    serve_job,
    supervise_job,
)
from dlrover.cli.status_view import failure_lines, hang_lines, plan_lines, status_text
from dlrover.client.master_client import MasterClient, MasterClientError
from dlrover.constants import (
    DEFAULT_NPROC_PER_NODE,
    DEFAULT_PS_REPLICA,
    DEFAULT_SUBMIT_MAX_RESTARTS,
)
from dlrover.coordination import PS_SCALE
from dlrover.engines.registry import BUILTIN_ENGINES
from dlrover.hang_spec import HangSpec
from dlrover.jobspec import (
    DEFAULT_ENGINE,
    PS_REPLICAS,
    JobSpecError,
    PsSpec,
    job_spec_from_flags,
    load_job_spec,
)
from dlrover.sharding.types import DeliveryMode

logger = logging.getLogger("dlrover.job")


def cmd_status(name: str) -> int:
    """``dlrover status NAME``: print the job's node table from its master, or its final state if it
    ended. Returns the exit code (1 if the master does not answer); NoSuchJobError if the job has no
    record."""
    try:
        text, _ = status_text(name)
    except MasterClientError as e:
        print(f"dlrover: error: job {name}'s master does not answer: {e}", file=sys.stderr)
        return 1
    print(text)
    return 0


def cmd_watch(name: str, every_s: float) -> int:
    """``dlrover status NAME --watch``: the table every ``every_s`` seconds (the screen cleared
    on a terminal) until the job ends; then its final state. Ctrl-C stops watching."""
    if every_s <= 0:
        print("dlrover: error: --watch needs a positive number of seconds", file=sys.stderr)
        return 2
    clear = "\033[H\033[2J" if sys.stdout.isatty() else ""
    try:
        while True:
            try:
                text, ended = status_text(name)
            except MasterClientError as e:
                text, ended = f"job {name}: its master does not answer ({e}); trying again", False
            if ended:
                print(text)
                return 0
            print(f"{clear}{time.strftime('%H:%M:%S')}  {text}", flush=True)
            time.sleep(every_s)
    except KeyboardInterrupt:
        return 0


def _failures_of(name: str) -> tuple[FailureRecord, ...]:
    """The job's failures: from its master while it runs, else from the state it left."""
    from dlrover.cli.job_records import job_dir
    from dlrover.master.diagnosis import load_folded
    from dlrover.master.state_store import StateStoreError, open_state_store

    record = read_record(name)
    if record.reachable:
        client = MasterClient(record.master_addr, record.token, rpc_timeout_s=5)
        try:
            return client.get_failures()
        except MasterClientError:
            pass  # gone meanwhile: read what it left
        finally:
            client.close()
    db = job_dir(name) / "master.db"
    if not db.exists():
        raise NoSuchJobError(f"job {name}'s master does not answer and left no state at {db}")
    try:
        store = open_state_store(str(db))
    except StateStoreError as e:
        raise NoSuchJobError(f"cannot read job {name}'s state: {e}") from None
    try:
        return load_folded(store)
    finally:
        store.close()


def cmd_diagnose(name: str, full: bool = False) -> int:
    """``dlrover diagnose NAME``: the job's failures, oldest first: when, which node, the class,
    the action taken, the root cause (its first line; ``full``: all of it)."""
    failures = _failures_of(name)
    if not failures:
        print(f"job {name}: no failures recorded")
    else:
        print(f"job {name}: {sum(max(1, f.count) for f in failures)} failure(s)")
        print("\n".join(failure_lines(failures, full)))
        hangs = hang_lines(failures)
        if hangs:
            print("\n".join(hangs))
    plans = plan_lines(name)
    if plans:
        print("\n".join(plans))
    return 0


def cmd_stop(name: str, timeout_s: float = 60.0) -> int:
    """``dlrover stop NAME``: ask the master to stop the job, then wait up to ``timeout_s`` seconds
    for the submitter to record the end (or die). Returns the exit code."""
    record = read_record(name)
    if not record.reachable:
        print(f"job {name} already ended: {record.state}")
        return 0
    client = MasterClient(record.master_addr, record.token, rpc_timeout_s=5)
    try:
        client.stop_job("stopped by dlrover stop")
    except MasterClientError as e:
        print(f"dlrover: error: cannot reach job {name}'s master: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    deadline = time.monotonic() + timeout_s
    pid = record.pid

    def ended() -> bool:
        # The submitter writes the final state last; a dead pid covers a submitter that crashed.
        return read_record(name).ended or not pid_alive(pid)

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
    """The ``dlrover`` command line: ``submit``, ``status``, ``logs``, ``diagnose``, ``stop``,
    ``scale``, ``dashboard``, ``top``."""
    p = argparse.ArgumentParser(
        prog="dlrover", description="Submit, inspect and stop DLRover jobs.", allow_abbrev=False
    )
    sub = p.add_subparsers(dest="command", required=True)
    # No abbreviations: a script argument that abbreviates a flag would be refused as ambiguous.
    s = sub.add_parser(
        "submit",
        help="Run a job: a YAML job spec, or flags and an entry point.",
        allow_abbrev=False,
    )
    s.add_argument(
        "spec_or_entrypoint", help="job.yaml, or the training script when flags describe the job"
    )
    s.add_argument("args", nargs=argparse.REMAINDER, help="Arguments of the training script.")
    s.add_argument(
        "--engine",
        default=DEFAULT_ENGINE,
        help=f"one of {', '.join(BUILTIN_ENGINES.names)} (default {DEFAULT_ENGINE})",
    )
    s.add_argument("--nnodes", default="1", help="N or MIN:MAX")
    s.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=DEFAULT_NPROC_PER_NODE)
    s.add_argument("--name", default=None, help="Job name (default: from the entry point)")
    s.add_argument(
        "--max-restarts", "--max_restarts", type=int, default=DEFAULT_SUBMIT_MAX_RESTARTS
    )
    s.add_argument("--cpu", type=float, default=0.0)
    s.add_argument("--memory", default="0", help="Per node, e.g. 8Gi")
    s.add_argument("--gpu", type=int, default=0)
    s.add_argument(
        "--node-check",
        action="store_true",
        help="Check every node before training (see dlrover-run)",
    )
    s.add_argument(
        "--exclude-straggler",
        action="store_true",
        help="Replace stragglers: found by --node-check, or slow while training (runtime scores)",
    )
    s.add_argument(
        "--compile-cache",
        default=None,
        metavar="DIR|master",
        help="A folder every node reaches (a shared filesystem) for the workers' compile caches, "
        "or 'master': the master keeps the job's copy, no shared filesystem needed (each "
        "agent's --compile-cache)",
    )
    s.add_argument(
        "--delivery-mode",
        default=None,
        choices=[mode.value for mode in DeliveryMode],
        help="How the workers' datasets and streams deliver data when their code names no mode "
        "(the job spec's delivery_mode; DLROVER_DELIVERY_MODE in the workers' environment)",
    )
    s.add_argument(
        "--spares",
        type=int,
        default=None,
        help="Hot spare nodes beyond max nodes: they register, warm up and wait; a lost node's "
        "place is taken by one without a launch (default 0)",
    )
    s.add_argument(
        "--hang-timeout",
        default=None,
        help="Hang detection of every node (each agent's --hang-timeout): auto (the default: "
        "timeouts learned per phase), off, seconds for every phase, or per phase "
        "(step=120,eval=off,min=10)",
    )
    s.add_argument(
        "--auto-scale",
        action="store_true",
        help="The master sizes nodes from their measured use (and scales them as that lands)",
    )
    s.add_argument(
        "--capacity",
        default="",
        help="What the local engine may use for all nodes together, e.g. cpu=8,memory=32Gi",
    )
    s.add_argument(
        "--ps",
        type=int,
        default=0,
        metavar="N",
        help="Start N embedding servers (dlrover-ps) for ElasticEmbedding; see docs/embedding.md",
    )
    s.add_argument(
        "--ps-replica",
        default=None,
        choices=PS_REPLICAS,
        help="How each embedding server keeps its rows on the next: async (default), sync "
        "(a failover loses nothing), none",
    )
    s.add_argument("--port", type=int, default=0, help="The master's port (0: a free one)")
    s.add_argument(
        "--tensorboard-dir",
        default="",
        help="Also write the job's metrics (goodput, badput, steps, nodes) as TensorBoard event "
        "files here, every 10 s.",
    )
    s.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="Port of the master's /metrics and dashboard (default 0: a free one; -1: none)",
    )
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
    st.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="Print the table again every SECONDS (default 2) until the job ends",
    )
    dg = sub.add_parser(
        "diagnose", help="The job's failures: class (user_error, oom, hang, ...), cause, action."
    )
    dg.add_argument("name")
    dg.add_argument("--full", action="store_true", help="Print whole root causes (tracebacks)")
    sp = sub.add_parser("stop", help="End a job: workers stop, nodes are removed.")
    sp.add_argument("name")
    sp.add_argument("--timeout", type=float, default=60.0)
    lg = sub.add_parser(
        "logs", help="A job's logs: every rank's, one rank's (--rank) or a node's own (--node)."
    )
    lg.add_argument("name")
    lg.add_argument("--node", default=None, help="A node id, or a node rank (status shows both)")
    lg.add_argument("--rank", type=int, default=None, help="A worker's global rank")
    lg.add_argument(
        "-f", "--follow", action="store_true", help="Keep printing new lines until the job ends"
    )
    lg.add_argument("-n", "--lines", type=int, default=100, help="Lines of each log (default 100)")
    add_dashboard_parsers(sub)
    sc = sub.add_parser(
        "scale",
        help="Change a running job's embedding servers or TensorFlow ps (--role ps).",
    )
    sc.add_argument("name")
    sc.add_argument("--role", default="ps", help="The role to scale (ps)")
    sc.add_argument("--count", type=int, required=True, help="How many nodes of the role")
    sc.add_argument(
        "--timeout", type=float, default=300.0, help="Seconds to wait for it (default 300)"
    )
    return p


def _ps_from_flags(spec: PsSpec | None, count: int, replica: str | None) -> PsSpec | None:
    """A YAML spec's ps role with ``--ps N`` / ``--ps-replica`` applied over it."""
    if not count and replica is None:
        return spec
    if spec is None and not count:
        raise JobSpecError("--ps-replica needs embedding servers: add --ps N or roles.ps")
    base = spec or PsSpec(count)
    count = count or base.count
    return dataclasses.replace(
        base, count=count, max_count=max(base.max_count, count), replica=replica or base.replica
    )


SCALE_RPC_TIMEOUT_S = 30.0
"""How long one call of `dlrover scale` waits for the master's answer."""


def cmd_scale(name: str, role: str, count: int, timeout_s: float = 300.0) -> int:
    """``dlrover scale NAME --role ps --count N``: ask the master, wait for it to be done and
    print what moved. Returns the exit code."""
    record = read_record(name)
    if not record.reachable:
        print(f"dlrover: error: job {name} already ended: {record.state}", file=sys.stderr)
        return 1
    # A master moving embedding rows on a busy machine can take long to answer a call.
    client = MasterClient(record.master_addr, record.token, rpc_timeout_s=SCALE_RPC_TIMEOUT_S)
    try:
        said, request = client.scale_role(role, count)
        print(said, flush=True)
        deadline = time.monotonic() + timeout_s
        quiet = False
        while time.monotonic() < deadline:
            try:
                report = PS_SCALE.get(client)
            except MasterUnreachableError as e:
                # Busy, or killed and started again by `dlrover submit`: the request stands.
                if not quiet:
                    print(
                        f"dlrover: the master did not answer ({e}); still waiting", file=sys.stderr
                    )
                    quiet = True
                continue
            if report is None or report.request != request:
                time.sleep(0.2)  # another process writes it: nothing to wait on but the key
                continue
            if report.error:
                print(f"dlrover: error: scaling failed: {report.error}", file=sys.stderr)
                return 1
            if report.tf:
                print(
                    f"job {name}: {report.servers} ps serve, "
                    f"{report.seconds or 0.0:.1f}s after the request; the chief "
                    "re-partitions the variables over them from its next checkpoint"
                )
                return 0
            print(
                f"job {name}: {report.servers} embedding servers in "
                f"{report.seconds or 0.0:.1f}s: {report.moved_buckets or 0} buckets, "
                f"{report.moved_rows or 0} rows moved; moving buckets paused "
                f"{report.pause_s or 0.0:.2f}s, training went on"
            )
            return 0
    except MasterClientError as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(f"dlrover: error: job {name} did not scale within {timeout_s:.0f}s", file=sys.stderr)
    return 1


def run(argv: Sequence[str] | None = None) -> int:
    """Run ``dlrover`` with ``argv`` (default: sys.argv) and return its exit code; ``submit`` serves
    the job from this process until it ends."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "status":
            if args.watch is not None:
                return cmd_watch(args.name, args.watch)
            return cmd_status(args.name)
        if args.command == "stop":
            return cmd_stop(args.name, args.timeout)
        if args.command == "scale":
            return cmd_scale(args.name, args.role, args.count, args.timeout)
        if args.command == "diagnose":
            return cmd_diagnose(args.name, args.full)
        if args.command == "logs":
            return cmd_logs(args.name, args.node, args.rank, args.follow, args.lines)
        code = run_dashboard_command(args)
        if code is not None:
            return code
    except NoSuchJobError as e:
        print(f"dlrover: error: {e}", file=sys.stderr)
        return 1
    try:
        target = args.spec_or_entrypoint
        if target.endswith((".yaml", ".yml")):
            spec = load_job_spec(target)
            # Flags given with a YAML spec add to it (never silently ignored).
            settings = dict(spec.engine_settings)
            if args.capacity:
                settings["capacity"] = args.capacity
            spec = dataclasses.replace(
                spec,
                node_check=spec.node_check or args.node_check,
                exclude_straggler=spec.exclude_straggler or args.exclude_straggler,
                auto_scale=spec.auto_scale or args.auto_scale,
                hang_timeout=spec.hang_timeout
                if args.hang_timeout is None
                else HangSpec.parse(args.hang_timeout).text(),
                engine_settings=settings,
                ps=_ps_from_flags(spec.ps, args.ps, args.ps_replica),
                spares=spec.spares if args.spares is None else args.spares,
                compile_cache=spec.compile_cache
                if args.compile_cache is None
                else args.compile_cache,
                delivery_mode=spec.delivery_mode
                if args.delivery_mode is None
                else args.delivery_mode,
            )
        else:
            if args.ps_replica is not None and not args.ps:
                raise JobSpecError("--ps-replica needs embedding servers: add --ps N")
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
                node_check=args.node_check,
                exclude_straggler=args.exclude_straggler,
                auto_scale=args.auto_scale,
                engine_settings={"capacity": args.capacity} if args.capacity else None,
                ps=args.ps,
                ps_replica=args.ps_replica or DEFAULT_PS_REPLICA,
                hang_timeout=args.hang_timeout,
                spares=args.spares or 0,
                compile_cache=args.compile_cache or "",
                delivery_mode=args.delivery_mode or "",
            )
    except (JobSpecError, OSError) as e:
        parser.error(str(e))
    setup_logging("dlrover")
    if BUILTIN_ENGINES.get(spec.engine).master_on_cluster:
        from dlrover.cli.ray_master import submit_to_ray

        return submit_to_ray(
            spec,
            port=args.port,
            advertise=args.advertise_address,
            relaunch_delay_s=args.relaunch_delay,
        )
    supervised = os.environ.pop(ENV_SUPERVISED, "")
    if not supervised:
        argv = list(sys.argv[1:] if argv is None else argv)
        if args.metrics_port < 0:
            return supervise_job(spec, argv, port=args.port)
        return supervise_job(spec, argv, port=args.port, metrics_port=args.metrics_port)
    port, state = supervised.split(":", 1)
    metrics = os.environ.pop(ENV_SUPERVISED_METRICS_PORT, "")
    return serve_job(
        spec,
        port=int(port),
        advertise=args.advertise_address,
        relaunch_delay_s=args.relaunch_delay,
        state=state,
        metrics_port=None if args.metrics_port < 0 else int(metrics or args.metrics_port),
        tensorboard_dir=args.tensorboard_dir,
    )


def main() -> None:
    """Console entry point of ``dlrover``: exits with ``run()``'s code. Output piped into a
    reader that stopped reading (`dlrover logs -f NAME | head`) ends it quietly with 0.
    SIGUSR1 prints every thread's stack to stderr (a command that seems stuck says where)."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        code = run()
        sys.stdout.flush()
    except BrokenPipeError:
        # Python's advice: point stdout at /dev/null, so the flush at exit raises no more.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    main()
