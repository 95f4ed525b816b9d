"""`dlrover-tf-node`: one node of a TensorFlow parameter-server job. It registers the address
its role will serve on with the job's master, waits for the cluster spec that names it, sets
TF_CONFIG and runs the role's program: it becomes a TF server for ps and worker (exec), and
runs the entrypoint of the chief and the evaluator as its child, whose end and usage it
reports. No TensorFlow is imported here."""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from dlrover import constants as c
from dlrover.agent.error_file import ENV_ERROR_FILE, ErrorFileError, read_error_file
from dlrover.agent.failure_policy import CANNOT_START_ERRORS
from dlrover.checkpoint.leftovers import owner_prefix, runtime_dir
from dlrover.cli.common import setup_logging
from dlrover.client.master_client import MasterClient, MasterClientError
from dlrover.coordination import TF_ADDRESS, TF_CLUSTER, TF_START_ERROR
from dlrover.trainer.tf.usage import UsageReporter, process_tree

logger = logging.getLogger("dlrover.tf_node")

DEFAULT_CLUSTER_WAIT_S = 600.0
"""How long a node waits for a cluster spec that names it (every node must register first)."""
EXIT_NO_MASTER = 2
EXIT_NO_CLUSTER = 3
SERVER_MODULE = "dlrover.trainer.tf.server"
"""What a ps or worker node runs: a TF server that tells the master once it serves."""


def build_parser() -> argparse.ArgumentParser:
    """The ``dlrover-tf-node`` command line (the master's TfController writes it)."""
    p = argparse.ArgumentParser(
        prog="dlrover-tf-node",
        description="Run one node of a TensorFlow parameter-server job launched by a DLRover "
        "master: register its address, wait for the cluster spec, run the role with TF_CONFIG.",
    )
    p.add_argument("--role", required=True, choices=("chief", "ps", "worker", "evaluator"))
    p.add_argument("--index", type=int, required=True, help="The task index within the role.")
    p.add_argument("--host", default="127.0.0.1", help="Address to serve on (default loopback).")
    p.add_argument(
        "--advertise",
        default="",
        help="The host others reach this node at (default: --host, or this machine's address "
        "when --host is 0.0.0.0).",
    )
    p.add_argument(
        "program", nargs=argparse.REMAINDER, help="-- ENTRYPOINT ARGS (chief, evaluator)"
    )
    return p


def _advertised_host(host: str, advertise: str) -> str:
    if advertise:
        return advertise
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


def _free_port(host: str, wanted: int) -> int:
    """``wanted`` if it can be bound now (the port of the attempt this node replaces: the others
    keep reaching the slot where they did), else a free port."""
    for port in (wanted, 0) if wanted else (0,):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host if host != "0.0.0.0" else "", port))
            except OSError as e:
                logger.warning("the slot's port %d cannot be bound (%s); taking another", port, e)
                continue
            return int(s.getsockname()[1])
    raise OSError(f"no port can be bound on {host}")


def _published(raw: bytes | None) -> tuple[int, dict[str, list[str]]]:
    """(version, role -> addresses) of the cluster spec stored as ``raw``; (0, {}) for none."""
    if not raw:
        return 0, {}
    spec = TF_CLUSTER.decode(raw)
    return spec.version, {role: list(addresses) for role, addresses in spec.cluster.items()}


def node_tmpdir(job: str, node: str) -> str:
    """A temp folder of this node's own (``<tmp>/dlrover.<job>.<node>.<pid>.tmp``), made the
    role's TMPDIR: TensorFlow writes a ``__autograph_generated_file*.py`` there for every
    function it converts and removes none of them when it is killed, which is how a ps or worker
    always ends. The chief's folder goes when its program ends; what a killed node leaves, the
    job's leftover sweep removes (its owner, this pid, is gone)."""
    path = os.path.join(runtime_dir(), owner_prefix(job, node, os.getpid()) + ".tmp")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def tf_config(cluster: dict[str, list[str]], role: str, index: int) -> str:
    """The TF_CONFIG of task ``role:index`` in ``cluster``."""
    return json.dumps({"cluster": cluster, "task": {"type": role, "index": index}})


def main(argv: Sequence[str] | None = None) -> int:
    """Register, wait for the cluster spec, exec the role's program; exit 2 without a master,
    3 when no cluster spec names this node in time."""
    args = build_parser().parse_args(argv)
    setup_logging("dlrover-tf-node")
    program = list(args.program)
    if program and program[0] == "--":
        program = program[1:]
    if args.role in ("chief", "evaluator") and not program:
        print(f"dlrover-tf-node: the {args.role} needs -- ENTRYPOINT", file=sys.stderr)
        return EXIT_NO_MASTER
    master, node = os.environ.get(c.ENV_MASTER_ADDR, ""), os.environ.get(c.ENV_NODE_NAME, "")
    token = os.environ.get(c.ENV_JOB_TOKEN, "")
    if not master or not node:
        print(
            f"dlrover-tf-node: {c.ENV_MASTER_ADDR} and {c.ENV_NODE_NAME} must be set (the master "
            "launches this command)",
            file=sys.stderr,
        )
        return EXIT_NO_MASTER
    client = MasterClient(master, token)
    try:
        client.wait_ready(60)
        if args.role in ("chief", "evaluator"):
            why = cannot_start(program)
            if why:  # fail now, before the cluster forms: no relaunch cures it
                cause = f"`{shlex.join(program)}`: {why}"
                print(f"dlrover-tf-node: the {args.role} cannot start {cause}", file=sys.stderr)
                TF_START_ERROR.put(client, cause, node)
                return c.CANNOT_START_EXIT_CODE
        cluster = _wait_for_cluster(client, node, args)
    except MasterClientError as e:
        print(f"dlrover-tf-node: the job's master at {master}: {e}", file=sys.stderr)
        return EXIT_NO_MASTER
    except TimeoutError as e:
        print(f"dlrover-tf-node: {e}", file=sys.stderr)
        return EXIT_NO_CLUSTER
    finally:
        client.close()
    version, spec = cluster
    tmp = node_tmpdir(os.environ.get(c.ENV_JOB_NAME, c.DEFAULT_JOB_NAME), node)
    env = {
        **os.environ,
        "TF_CONFIG": tf_config(spec, args.role, args.index),
        c.ENV_TF_CLUSTER_VERSION: str(version),
        "TMPDIR": tmp,
    }
    if args.role in ("ps", "worker"):
        argv_ = [sys.executable, "-u", "-m", SERVER_MODULE]
    else:
        argv_ = _program_argv(program)
    logger.info("%s %d: cluster spec version %d; running %s", args.role, args.index, version, argv_)
    sys.stdout.flush()
    sys.stderr.flush()
    if args.role in ("ps", "worker"):
        # exec: the engine's process is the server (it ends only when it is stopped or killed).
        os.execvpe(argv_[0], argv_, env)
    return _run_program(argv_, env, tmp, program)


BOOTSTRAP = ("-m", "dlrover.agent.bootstrap")
"""What runs a Python program of the chief: as ``python`` would, plus an error file of its
uncaught exception (so a program that cannot start is told from one that failed later)."""


def _python_target(program: list[str]) -> list[str] | None:
    """``[script, args...]`` or ``["-m", module, args...]`` when ``program`` is a Python program
    (a ``.py`` script, or ``python``/``python3`` with a script or ``-m``), else None."""
    if program[0].endswith(".py"):
        return program
    if os.path.basename(program[0]) in ("python", "python3") and len(program) > 1:
        rest = [a for a in program[1:] if a != "-u"]
        if rest and (rest[0] == "-m" or not rest[0].startswith("-")):
            return rest
    return None


def _program_argv(program: list[str]) -> list[str]:
    """The argv that runs ``program``: a Python program through this Python and the bootstrap
    (``python`` is the job's own interpreter), anything else as it is."""
    target = _python_target(program)
    if target is not None:
        return [sys.executable, "-u", *BOOTSTRAP, *target]
    if os.path.basename(program[0]) in ("python", "python3"):
        return [sys.executable, *program[1:]]
    return program


def cannot_start(program: list[str]) -> str:
    """Why ``program`` cannot start ("" when it can, as far as can be told without running it):
    no such executable, or a Python script that is missing or does not compile, or a ``-m``
    module that is not found. (An import error inside the program shows when it runs: the
    node then tells it from the program's error file, see `_run_program`.)"""
    target = _python_target(program)
    if target is None:
        exe = program[0]
        if shutil.which(exe) is None:
            if os.sep in exe and os.path.exists(exe):
                return f"{exe} is not executable"
            return f"no such program: {exe!r} (not a file, not on PATH)"
        return ""
    if target[0] == "-m":
        if len(target) < 2:
            return "-m names no module"
        sys.path.insert(0, os.getcwd())  # `python -m` looks in the working directory first
        try:
            found = importlib.util.find_spec(target[1])
        except (ImportError, ValueError) as exc:
            return f"module {target[1]!r} cannot be found: {type(exc).__name__}: {exc}"
        finally:
            sys.path.pop(0)
        return "" if found is not None else f"no module named {target[1]!r}"
    try:
        with open(target[0], "rb") as f:
            compile(f.read(), target[0], "exec")
    except OSError as exc:
        return f"cannot open {target[0]!r}: {exc.strerror}"
    except SyntaxError as exc:
        return f"{type(exc).__name__} in {exc.filename} line {exc.lineno}: {exc.msg}"
    return ""


def _pdeathsig() -> None:
    """In the child: die by SIGKILL with this process (a SIGKILLed node leaves nothing)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


def _start_error(path: str) -> str:
    """The program's uncaught exception from its error file when it says the program could
    not start (an import or syntax error: CANNOT_START_ERRORS), else ""."""
    try:
        record = read_error_file(path)
    except (OSError, ErrorFileError):
        return ""
    if record is None:
        return ""
    short = record.exception_type.rsplit(".", 1)[-1]
    return f"{short}: {record.message}" if short in CANNOT_START_ERRORS else ""


def _run_program(argv: list[str], env: dict[str, str], tmp: str, program: list[str]) -> int:
    """Run the chief's (evaluator's) program as a child and end as it did: its exit code, also
    written to $DLROVER_NODE_EXIT_FILE like dlrover-run does (an engine of a restarted master
    that adopted this node learns the end from it), or its signal; CANNOT_START_EXIT_CODE
    (the cause told to the master) when its error file names an import or syntax error.
    SIGTERM and SIGINT are passed on. The program's temp folder ``tmp`` is removed once it
    ended."""
    error_file = os.path.join(tmp, "error.json")
    env = {**env, ENV_ERROR_FILE: error_file}
    child = subprocess.Popen(argv, env=env, preexec_fn=_pdeathsig)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    client = MasterClient(env[c.ENV_MASTER_ADDR], env.get(c.ENV_JOB_TOKEN, ""))
    reporter = UsageReporter.from_env(client, lambda: process_tree(os.getpid()))
    if reporter is not None:
        reporter.start()
    try:
        code = child.wait()  # the program's whole run: the master bounds the job
        if code > 0:
            why = _start_error(error_file)
            if why:  # its code or imports are wrong: no relaunch cures that
                cause = f"`{shlex.join(program)}`: {why}"
                logger.error("the program cannot start: %s", cause)
                TF_START_ERROR.put(client, cause, env.get(c.ENV_NODE_NAME, ""))
                code = c.CANNOT_START_EXIT_CODE
    finally:
        if reporter is not None:
            reporter.stop()
        client.close()
    shutil.rmtree(tmp, ignore_errors=True)
    exit_file = os.environ.get(c.ENV_NODE_EXIT_FILE, "")
    if exit_file:
        try:
            with open(exit_file, "w") as f:
                f.write(str(code if code >= 0 else 128 - code))
        except OSError as e:
            logger.warning("cannot write the exit code to %s: %s", exit_file, e)
    if code < 0:  # end by the same signal, so the engine reports the signal
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _wait_for_cluster(
    client: MasterClient, node: str, args: argparse.Namespace
) -> tuple[int, dict[str, list[str]]]:
    """Register this node's address and return the first cluster spec that names it."""
    version, cluster = _published(TF_CLUSTER.raw(client))
    deadline = time.monotonic() + DEFAULT_CLUSTER_WAIT_S
    if args.role == "evaluator":  # not in the cluster: any spec will do
        if not version:
            first = TF_CLUSTER.raw(client, version=1, wait_s=DEFAULT_CLUSTER_WAIT_S)
            version, cluster = _published(first)
        if not version:
            raise TimeoutError(f"no cluster spec within {DEFAULT_CLUSTER_WAIT_S:.0f}s")
        return version, cluster
    host = _advertised_host(args.host, args.advertise)
    previous = cluster.get(args.role, [])
    wanted = 0
    if args.index < len(previous) and previous[args.index].rpartition(":")[0] == host:
        wanted = int(previous[args.index].rpartition(":")[2])
    address = f"{host}:{_free_port(args.host, wanted)}"
    TF_ADDRESS.put(client, address, node)
    logger.info("%s registered %s", node, address)
    while True:
        mine = cluster.get(args.role, [])
        if args.index < len(mine) and mine[args.index] == address:
            return version, cluster
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"no cluster spec named {node} at {address} within {DEFAULT_CLUSTER_WAIT_S:.0f}s "
                f"(last: version {version}); did every node of the job start?"
            )
        raw = TF_CLUSTER.raw(client, version=version + 1, wait_s=min(left, 30.0))
        if raw:
            version, cluster = _published(raw)


if __name__ == "__main__":
    sys.exit(main())
