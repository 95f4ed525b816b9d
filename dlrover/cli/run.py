"""`dlrover-run`: torchrun's command line, with an elastic, fault-tolerant agent behind it."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import logging
import os
import shutil
import sys
import time
import uuid
from collections.abc import Sequence

from dlrover import constants as c
from dlrover.agent.agent import ElasticAgent, SignalReceived, install_signal_handlers
from dlrover.agent.config import AgentConfig
from dlrover.agent.launch_plan import CACHE_ON_MASTER
from dlrover.agent.workers import STD_ALL
from dlrover.cli.common import parse_nnodes, parse_std_spec, setup_logging
from dlrover.client.master_client import MasterClient, MasterClientError
from dlrover.envvars import number_from_env
from dlrover.faults import ENV_FAULTS
from dlrover.faults.throttle import SlowFaults
from dlrover.hang_spec import HangSpec
from dlrover.master.assembly import MasterSettings, RunningMaster, build_master
from dlrover.master.server import MasterServerError, job_name_for_token, new_token
from dlrover.master.tensorboard import TensorBoardError
from dlrover.master.web import WebError
from dlrover.processes import pid_alive
from dlrover.runner.records import (
    JobRecord,
    has_record,
    read_record,
    remove_final,
    write_history,
    write_record,
)

logger = logging.getLogger("dlrover.run")


def _add(p: argparse.ArgumentParser, name: str, **kw: object) -> None:
    """Add a flag under its dash spelling and torchrun's underscore spelling."""
    names = [name]
    if "-" in name[2:]:
        names.append("--" + name[2:].replace("-", "_"))
    p.add_argument(*names, **kw)  # type: ignore[arg-type]


def build_parser() -> argparse.ArgumentParser:
    """The ``dlrover-run`` command line: torchrun's flags (dash and underscore spellings) and
    DLRover's own."""
    # No abbreviations: a script argument after the script (``--compile inductor``) that
    # abbreviates one of these flags would otherwise be refused as ambiguous.
    p = argparse.ArgumentParser(
        prog="dlrover-run",
        allow_abbrev=False,
        description="Launch a PyTorch training script on this node, like torchrun, with workers "
        "restarted in place, elastic membership and an embedded or remote DLRover master.",
    )
    _add(p, "--nnodes", default="1:1", help="Number of nodes, N or MIN:MAX (default 1).")
    _add(
        p,
        "--nproc-per-node",
        default="1",
        help="Worker processes per node: an integer, or auto/cpu (one per CPU), gpu (one per GPU).",
    )
    _add(
        p,
        "--rdzv-backend",
        default="static",
        help="Accepted for torchrun compatibility; rendezvous always goes through the DLRover master.",
    )
    _add(
        p,
        "--rdzv-endpoint",
        default="",
        help="host:port of the master. The node that can bind it hosts the master; the others join it.",
    )
    _add(p, "--rdzv-id", default=c.DEFAULT_JOB_NAME, help="The job's id, the same on every node.")
    _add(
        p,
        "--rdzv-conf",
        default="",
        help="key=value,... : join_timeout (s), last_call_timeout (s), node_unit.",
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        help="Single node, master embedded on a free local port: no infrastructure.",
    )
    _add(
        p,
        "--metrics-port",
        type=int,
        default=0,
        help="Where a master this node hosts serves /metrics and its dashboard (default 0: a "
        "free port, printed; -1: none).",
    )
    _add(
        p,
        "--tensorboard-dir",
        default="",
        help="A master this node hosts also writes the job's metrics as TensorBoard event files "
        "here.",
    )
    _add(
        p,
        "--max-restarts",
        type=int,
        default=c.DEFAULT_MAX_RESTARTS,
        help="Worker-group restarts after failures before the node gives up (default 0).",
    )
    _add(
        p,
        "--monitor-interval",
        type=float,
        default=c.DEFAULT_MONITOR_INTERVAL_S,
        help="Seconds between checks of membership and worker state (default 0.1).",
    )
    _add(
        p,
        "--start-method",
        default="spawn",
        choices=["spawn", "fork", "forkserver"],
        help="Accepted for torchrun compatibility; workers are always fresh processes.",
    )
    p.add_argument("--role", default=c.DEFAULT_ROLE, help="The workers' role name (ROLE_NAME).")
    p.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="Run the entry point as a module, like python -m.",
    )
    _add(
        p,
        "--no-python",
        action="store_true",
        help="Run the entry point as a program, not through python.",
    )
    _add(
        p,
        "--run-path",
        action="store_true",
        help="Run the script with runpy.run_path (the same as the default here).",
    )
    _add(
        p,
        "--log-dir",
        default=None,
        help="Root of per-attempt per-rank logs: <log-dir>/<rdzv-id>/attempt_<n>/rank_<r>/.",
    )
    p.add_argument(
        "-r",
        "--redirects",
        default="0",
        help="Send worker streams to files only: 0 none, 1 stdout, 2 stderr, 3 both; or 0:1,1:2.",
    )
    p.add_argument(
        "-t",
        "--tee",
        default="0",
        help="Send worker streams to files and the console (same syntax as --redirects).",
    )
    _add(p, "--local-ranks-filter", default="", help="Accepted for torchrun compatibility.")
    _add(
        p,
        "--node-rank",
        type=int,
        default=-1,
        help="This node's rank; by default the master assigns stable ranks.",
    )
    _add(
        p,
        "--master-addr",
        default="",
        help="Where the rank-0 worker hosts the process-group store (default: node 0's address).",
    )
    _add(
        p,
        "--master-port",
        type=int,
        default=0,
        help="The store's port (default: a fresh free port every round, so restarts never see stale keys).",
    )
    _add(p, "--local-addr", default="", help="This node's address as the other nodes reach it.")
    _add(p, "--logs-specs", default=None, help="Accepted for torchrun compatibility.")
    _add(
        p,
        "--shutdown-timeout",
        type=float,
        default=c.DEFAULT_STOP_GRACE_S,
        help="Seconds between SIGTERM and SIGKILL when stopping workers (default 5).",
    )
    p.add_argument(
        "--token",
        default=None,
        help=f"The job token (default: ${c.ENV_JOB_TOKEN}, or generated when the master is embedded).",
    )
    _add(
        p,
        "--node-unit",
        type=int,
        default=None,
        help="The number of nodes is always a multiple of this (default 1).",
    )
    _add(
        p,
        "--hang-timeout",
        default="auto",
        help="Hang detection: auto (default) learns each phase's timeout (start-up, steps, "
        "checkpoint, eval, sections marked with dlrover.trainer.section) from the job's own "
        "durations and confirms a hang from the workers' stacks; a hung worker's stacks are dumped "
        "and it restarts like a failed one. S: every phase fixed at S seconds. Per phase: "
        "step=120,eval=off,min=10 (min/max: floor/cap of learned timeouts). 0 or off: none.",
    )
    _add(
        p,
        "--hang-warning-timeout",
        type=float,
        default=c.DEFAULT_HANG_WARNING_TIMEOUT_S,
        help="Seconds without progress (a new reported step; for scripts that never report one, "
        "CPU use) before the stuck ranks are logged with their stacks; the job goes on. "
        "0: off. Default 600.",
    )
    _add(
        p,
        "--exit-hang-timeout",
        type=float,
        default=c.DEFAULT_EXIT_HANG_TIMEOUT_S,
        help="Seconds a worker may sit idle (no step, under 1%% of a core) after its script "
        "returned, or after every other worker of the node exited successfully, before it counts "
        "as hung at exit: its stacks are logged, it is ended and counted as what its script "
        "returned (failed if it never returned). 0: off. Default 60.",
    )
    _add(
        p,
        "--compile-cache",
        default="",
        metavar="DIR|master",
        help="A folder every node of the job reaches (a shared filesystem): the workers' "
        "inductor and Triton caches live there, so a replacement on a fresh machine compiles "
        "from the job's cache (unless TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR are set). "
        "'master': no shared filesystem needed; each node keeps the caches in a folder of its "
        "machine, sends what its workers compile to the master, and a node on a fresh machine "
        "fetches the job's files before its workers start. Default: torch's own, per machine.",
    )
    _add(
        p,
        "--release-timeout",
        type=float,
        default=c.DEFAULT_RELEASE_TIMEOUT_S,
        help="In-process recovery (a training function wrapped in "
        "dlrover.trainer.torch.inprocess.Wrapper): seconds a surviving worker gets to leave its "
        "failed step after a failure elsewhere; one that does not is restarted. Default 30.",
    )
    _add(
        p,
        "--master-lost-timeout",
        type=float,
        default=c.DEFAULT_MASTER_LOST_TIMEOUT_S,
        help="Seconds the job's master may leave heartbeats unanswered before this node takes it "
        "for gone: it stops its workers (persisting the newest in-memory checkpoint) and exits "
        f"with code {c.EXIT_MASTER_LOST}. A master that restarts on its state within it is not "
        "noticed. 0: never. Default 600.",
    )
    p.add_argument(
        "--node-check",
        "--node_check",
        "--network-check",
        "--network_check",
        dest="node_check",
        action="store_true",
        help="Before training, check every node: a compute test (matmul) and a collective test "
        "(allreduce in pairs of nodes); a faulty node is named within 2 check rounds and leaves "
        "the job (its engine replaces it), stragglers are logged. Needs torch on every node.",
    )
    _add(
        p,
        "--exclude-straggler",
        action="store_true",
        help="With --node-check: a straggler leaves the job too (its engine replaces it).",
    )
    _add(
        p,
        "--straggler-ratio",
        type=float,
        default=2.0,
        help="A node whose check compute time is above this multiple of the other nodes' median "
        "is a straggler (default 2).",
    )
    p.add_argument(
        "--fast-restart",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Fork the workers, at the first start and at restarts, from a process that has "
        "imported torch already, so the node imports it once and a restart skips the imports "
        "(default on; --no-fast-restart starts every worker as a fresh interpreter).",
    )
    p.add_argument("training_script", help="The script (or module, or program) every worker runs.")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def _parse_rdzv_conf(value: str) -> dict[str, str]:
    conf: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in value.split(","))):
        if "=" not in item:
            raise ValueError(f"--rdzv-conf item {item!r}: expected key=value")
        k, v = item.split("=", 1)
        conf[k.strip()] = v.strip()
    return conf


def _nproc(value: str) -> int:
    if value in ("auto", "cpu"):
        return os.cpu_count() or 1
    if value == "gpu":
        raise ValueError("--nproc-per-node gpu: give the number of GPUs explicitly on this build")
    try:
        n = int(value)
    except ValueError:
        raise ValueError(
            f"--nproc-per-node {value!r}: expected a positive integer, auto or cpu"
        ) from None
    if n < 1:
        raise ValueError(f"--nproc-per-node {value!r}: must be at least 1")
    return n


def _entrypoint(args: argparse.Namespace) -> tuple[list[str], list[str] | None]:
    """(argv of a fresh worker, the script part a zygote can run); the second is None when the
    entry point is not Python (--no-python)."""
    script = args.training_script
    if args.no_python:
        if args.module:
            raise ValueError("--no-python and --module cannot be used together")
        if shutil.which(script) is None and not os.path.isfile(script):
            raise ValueError(f"program {script!r} not found (with --no-python it must be on PATH)")
        return [script, *args.training_script_args], None
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    if args.module:
        target = ["-m", script, *args.training_script_args]
    else:
        if not os.path.isfile(script):
            raise ValueError(f"training script {script!r} not found (cwd {os.getcwd()})")
        target = [script, *args.training_script_args]
    # The bootstrap runs the script exactly as `python -u script.py` would, and adds error
    # files, stack dumps on SIGUSR1 and a marker of a clean finish.
    return [python, "-u", "-m", "dlrover.agent.bootstrap", *target], target


def config_from_args(args: argparse.Namespace) -> AgentConfig:
    """Validate flags and build the agent's config; raises ValueError naming the bad flag."""
    lo, hi = parse_nnodes(args.nnodes)
    nproc = _nproc(args.nproc_per_node)
    conf = _parse_rdzv_conf(args.rdzv_conf)
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts {args.max_restarts}: must be >= 0")
    if args.exit_hang_timeout < 0:
        raise ValueError(
            f"--exit-hang-timeout {args.exit_hang_timeout}: must be >= 0 (0 turns it off)"
        )
    if args.compile_cache and args.compile_cache != CACHE_ON_MASTER:
        try:
            os.makedirs(args.compile_cache, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--compile-cache {args.compile_cache}: cannot create it: {e}") from e
        if not os.access(args.compile_cache, os.W_OK | os.X_OK):
            raise ValueError(f"--compile-cache {args.compile_cache}: not writable by this user")
    if args.release_timeout <= 0:
        raise ValueError(f"--release-timeout {args.release_timeout}: must be > 0")
    if args.master_lost_timeout < 0:
        raise ValueError(
            f"--master-lost-timeout {args.master_lost_timeout}: must be >= 0 (0 turns it off)"
        )
    args.hang = HangSpec.parse(args.hang_timeout)
    if args.hang_warning_timeout < 0:
        raise ValueError(
            f"--hang-warning-timeout {args.hang_warning_timeout}: must be >= 0 (0 turns it off)"
        )
    if args.straggler_ratio <= 1:
        raise ValueError(f"--straggler-ratio {args.straggler_ratio}: must be > 1")
    if args.exclude_straggler and not args.node_check:
        raise ValueError("--exclude-straggler needs --node-check (stragglers are found by it)")
    if args.monitor_interval <= 0:
        raise ValueError(f"--monitor-interval {args.monitor_interval}: must be > 0")
    red_default, red = parse_std_spec(args.redirects, "--redirects")
    tee_default, tee = parse_std_spec(args.tee, "--tee")
    node_unit = args.node_unit if args.node_unit is not None else int(conf.get("node_unit", "1"))
    if node_unit < 1:
        raise ValueError(f"--node-unit {node_unit}: must be >= 1")
    if args.standalone and hi > 1:
        raise ValueError(
            f"--standalone runs one node but --nnodes is {args.nnodes}: drop --standalone and "
            f"start dlrover-master, or give --rdzv-endpoint"
        )
    log_dir = args.log_dir or ""
    engine_logs = os.environ.get(c.ENV_RANK_LOG_DIR, "")
    if engine_logs and not log_dir and not (red_default or tee_default or red or tee):
        # The engine that launched this node reads the per-rank files back (`dlrover logs`).
        log_dir, red_default = engine_logs, STD_ALL
    if (red_default or tee_default or red or tee) and not log_dir:
        import tempfile

        log_dir = tempfile.mkdtemp(prefix="dlrover_logs_")
    entrypoint, script_argv = _entrypoint(args)
    return AgentConfig(
        entrypoint=entrypoint,
        script_argv=script_argv,
        fast_restart=args.fast_restart,
        nproc_per_node=nproc,
        min_nodes=lo,
        max_nodes=hi,
        node_unit=node_unit,
        max_restarts=args.max_restarts,
        monitor_interval_s=args.monitor_interval,
        run_id=args.rdzv_id,
        role=args.role,
        log_dir=log_dir,
        redirects=red,
        tee=tee,
        default_redirect=red_default,
        default_tee=tee_default,
        requested_node_rank=args.node_rank,
        store_addr=args.master_addr,
        store_port=args.master_port,
        local_addr=args.local_addr,
        join_timeout_s=float(conf.get("join_timeout", c.DEFAULT_RDZV_JOIN_TIMEOUT_S)),
        last_call_timeout_s=float(
            conf.get("last_call_timeout", c.DEFAULT_RDZV_LAST_CALL_TIMEOUT_S)
        ),
        stop_grace_s=args.shutdown_timeout,
        hang=args.hang,
        exit_hang_timeout_s=args.exit_hang_timeout,
        release_timeout_s=args.release_timeout,
        compile_cache=args.compile_cache
        if args.compile_cache in ("", CACHE_ON_MASTER)
        else os.path.abspath(args.compile_cache),
        master_lost_timeout_s=args.master_lost_timeout,
        hang_warning_timeout_s=args.hang_warning_timeout,
        node_check=args.node_check,
        exclude_straggler=args.exclude_straggler,
        straggler_ratio=args.straggler_ratio,
        zygote_wait_s=number_from_env(
            c.ENV_ZYGOTE_WAIT_S, c.DEFAULT_ZYGOTE_WAIT_S, "a number of seconds"
        ),
    )


def _embedded_master(
    job_name: str, host: str, port: int, token: str, metrics_port: int, tensorboard_dir: str
) -> RunningMaster:
    master = build_master(
        MasterSettings(
            job_name=job_name,
            token=token,
            host=host,
            port=port,
            metrics_port=None if metrics_port < 0 else metrics_port,
            tensorboard_dir=tensorboard_dir,
        )
    )
    if master.web is not None:
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
        logger.info("metrics and dashboard: http://%s:%d/", shown, master.web.port)
    return master


RECORD_ENGINE = "dlrover-run"
"""The engine a record of a job hosted by ``dlrover-run`` names (its nodes are wherever their
``dlrover-run`` runs)."""


def _record_start(server: RunningMaster, master_addr: str, token: str) -> JobRecord | None:
    """Keep a record of the job whose master this process hosts in ``$DLROVER_HOME/jobs/`` (as
    `dlrover submit` does), so that `dlrover dashboard`, `status`, `top` and `stop` find it.
    None where a live job of the same name holds the record, or the home cannot be written."""
    name = server.job.config.job_name
    try:
        if has_record(name):
            old = read_record(name)
            if not old.ended and pid_alive(old.pid) and old.pid != os.getpid():
                logger.info("job %s: another live job keeps its record; none kept", name)
                return None
        remove_final(name)  # an earlier run of the same name
        record = JobRecord(
            name=name,
            state="running",
            pid=os.getpid(),
            master_addr=master_addr,
            token=token,
            engine=RECORD_ENGINE,
            web_port=server.web.port if server.web is not None else 0,
            started_at=time.time(),
        )
        write_record(record)
        logger.info(
            "job %s: `dlrover top %s` shows it live, `dlrover dashboard` lists it", name, name
        )
    except (OSError, ValueError, TypeError) as e:  # the job matters more than its record
        logger.warning("job %s: cannot keep its record in $DLROVER_HOME: %s", name, e)
        return None
    return record


def _record_end(server: RunningMaster, record: JobRecord) -> None:
    """The job's final state, history and outcome beside its record (what an ended job's
    `dlrover status`, `top` and dashboard page show)."""
    from dlrover.runner.job_runner import final_state  # at the end only: not on the start path
    from dlrover.runner.records import write_final

    job = server.job
    life = job.lifecycle
    ended = life.ended.is_set()
    try:
        write_final(record.name, final_state(job))
        if server.history is not None:
            server.history.sample(job.clock())
            write_history(record.name, server.history.document())
        write_record(
            dataclasses.replace(
                record,
                state=life.state.value if ended else "failed",
                reason=life.reason if ended else "dlrover-run stopped before the job ended",
                exit_code=life.exit_code if ended else 1,
                ended_at=time.time(),
            )
        )
    except OSError as e:
        logger.warning("job %s: cannot record its end in $DLROVER_HOME: %s", record.name, e)


def _is_local(host: str) -> bool:
    import socket

    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0", ""):
        return True
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return False
    return addr.startswith("127.") or host in (socket.gethostname(), socket.getfqdn())


def run(argv: Sequence[str] | None = None) -> int:
    """Run ``dlrover-run``: find or start the master (embedded for --standalone or a single node
    without an address; else DLROVER_MASTER_ADDR; else --rdzv-endpoint, hosted by the node that
    can bind it), then run this node's agent until the job ends. Returns the job's exit code,
    128 + the signal number when a signal stopped it, 1 when the master cannot be reached."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    setup_logging("dlrover-run")
    # Without --rdzv-id an embedded master names the job; a node joining another master takes
    # the name that master reports when the node registers.
    named = config.run_id != c.DEFAULT_JOB_NAME

    token = args.token or os.environ.get(c.ENV_JOB_TOKEN, "")
    env_addr = os.environ.get(c.ENV_MASTER_ADDR, "")
    server: RunningMaster | None = None
    try:
        if args.standalone or (not env_addr and not args.rdzv_endpoint and config.max_nodes == 1):
            token = token or new_token()
            if not named:
                config = dataclasses.replace(config, run_id=uuid.uuid4().hex[:8])
            server = _embedded_master(
                config.run_id, "127.0.0.1", 0, token, args.metrics_port, args.tensorboard_dir
            )
            master_addr = f"127.0.0.1:{server.port}"
        elif env_addr:
            master_addr = env_addr
        elif args.rdzv_endpoint:
            host, _, port_s = args.rdzv_endpoint.rpartition(":")
            if not host or not port_s.isdigit():
                parser.error(f"--rdzv-endpoint {args.rdzv_endpoint!r}: expected host:port")
            # Every node derives the same token from the job id unless one is given.
            token = token or hashlib.sha256(f"dlrover:{config.run_id}".encode()).hexdigest()[:32]
            master_addr = args.rdzv_endpoint
            if _is_local(host):
                try:
                    job_name = config.run_id if named else job_name_for_token(token)
                    server = _embedded_master(
                        job_name,
                        "0.0.0.0",
                        int(port_s),
                        token,
                        args.metrics_port,
                        args.tensorboard_dir,
                    )
                    logger.info("this node hosts the job master at %s", master_addr)
                except MasterServerError:
                    # Only the gRPC port: a taken metrics port or a bad --tensorboard-dir are
                    # this node's settings to fix (WebError, TensorBoardError), not a master.
                    logger.info("another node hosts the master at %s; joining it", master_addr)
        else:
            parser.error(
                f"--nnodes {args.nnodes} needs a master: set {c.ENV_MASTER_ADDR} and "
                f"{c.ENV_JOB_TOKEN} to what dlrover-master printed, or give --rdzv-endpoint host:port"
            )
    except (MasterServerError, WebError, TensorBoardError) as e:
        print(f"dlrover-run: error: {e}", file=sys.stderr)
        return 1
    record = _record_start(server, master_addr, token) if server is not None else None

    client = MasterClient(master_addr, token)
    install_signal_handlers()
    echo = None
    if config.log_dir and os.environ.get(c.ENV_RANK_LOG_ECHO, "") not in ("", "0"):
        from dlrover.agent.rank_echo import RankLogEcho

        echo = RankLogEcho(config.log_dir).start()
    try:
        client.wait_ready(c.DEFAULT_CONNECT_TIMEOUT_S if server is None else 5.0)
        agent = ElasticAgent(
            config, client, master_addr, token, SlowFaults(os.environ.get(ENV_FAULTS, ""))
        )
        result = agent.run()
        if result.exit_code == c.EXIT_NODE_OOM:
            print(f"dlrover-run: this node needs more memory: {result.reason}", file=sys.stderr)
        elif result.exit_code == c.EXIT_NODE_EXCLUDED:
            print(f"dlrover-run: this node left the job: {result.reason}", file=sys.stderr)
            if server is not None:
                # The job's master lives in this process: the other nodes need it to go on.
                print(
                    "dlrover-run: this node hosts the job's master; it keeps serving until the "
                    "job ends (Ctrl-C stops it)",
                    file=sys.stderr,
                    flush=True,
                )
                while not server.job.lifecycle.ended.wait(1.0):
                    pass  # bounded by the job; SIGTERM/SIGINT end it through SignalReceived
        elif result.exit_code != 0:
            print(f"dlrover-run: job failed: {result.reason}", file=sys.stderr)
        return result.exit_code
    except SignalReceived as e:
        logger.warning("%s: workers stopped", e)
        return 128 + e.signum
    except MasterClientError as e:
        print(f"dlrover-run: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # a clear line, not a stack trace, for anything the agent raises
        from dlrover.agent.agent import AgentError

        if not isinstance(e, AgentError):
            raise
        print(f"dlrover-run: error: {e}", file=sys.stderr)
        return 1
    finally:
        if echo is not None:
            echo.stop()
        client.close()
        if server is not None:
            if record is not None:
                _record_end(server, record)
            server.stop(grace_s=0.5)


def main() -> None:
    """Console entry point of ``dlrover-run``: exits with ``run()``'s code (also written to
    $DLROVER_NODE_EXIT_FILE when the engine asks for it)."""
    code = run()
    exit_file = os.environ.get(c.ENV_NODE_EXIT_FILE, "")
    if exit_file:
        try:
            with open(exit_file, "w") as f:
                f.write(str(code))
        except OSError as e:
            print(f"dlrover-run: cannot write the exit code to {exit_file}: {e}", file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
