"""Shared test helpers: launch dlrover-run / dlrover-master as real processes."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from tests.cpu_cost import CpuCost
from tests.stages import StageCheck
from tests.stalls import process_report

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"


TEST_HOME = tempfile.mkdtemp(prefix="dlrover-test-home-")
"""$DLROVER_HOME of every job a test starts without one of its own: the records a `dlrover-run`
that hosts its master keeps (as `dlrover submit`'s) go here, not into the tester's ~/.dlrover."""
atexit.register(shutil.rmtree, TEST_HOME, ignore_errors=True)
os.environ.setdefault("DLROVER_HOME", TEST_HOME)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(StageCheck(), "dlrover-test-stages")
    config.pluginmanager.register(CpuCost(), "dlrover-test-cpu")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--dist loadgroup``: give each test marked ``xdist_group(name)`` the ``@name`` suffix
    xdist's scheduler groups by. pytest-xdist 3.8 sets it by rewriting ``item._nodeid``, which
    pytest 9.2 no longer reads (a node's id is ``item._id`` now), so without this no group was
    kept together: each worker ran its own copy of a group's session fixture (the DeepSpeed and
    Megatron jobs) and the Ray tests ran beside each other.

    ``--dist worksteal``: the tests marked ``long`` go first (`_long_first`)."""
    if getattr(config.option, "dist", "") == "worksteal":
        workers = getattr(config.option, "numprocesses", None)
        _long_first(items, workers if isinstance(workers, int) else 1)
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodeid import coerce_node_id

    group_of: dict[int, str] = {}  # id(item) -> its group
    for item in items:
        names = sorted(
            {
                str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                for mark in item.iter_markers("xdist_group")
            }
        )
        if names:
            group_of[id(item)] = "_".join(names)
            if "@" not in item.nodeid:
                item._id = coerce_node_id(f"{item.nodeid}@{group_of[id(item)]}")
    # A group runs whole in one worker, in the order collected: the largest first, so that no
    # worker starts a 7-minute group (the TensorFlow jobs, collected last) when the other is
    # nearly done. The scheduler hands out work in this order.
    sizes = Counter(group_of.values())
    items.sort(key=lambda item: -sizes.get(group_of.get(id(item), ""), 0))


def _long_first(items: list[pytest.Item], workers: int) -> None:
    """Put the ``long`` tests at the head of each worker's share. pytest-xdist's worksteal
    scheduler hands each worker a contiguous slice of the collection (the first worker the first
    len/N tests, ...), and an idle worker steals the back half of another's queue: a long test
    at the back of a slice ran last, while the other worker sat idle until it ended (about 30 s
    of each stage's end). At the head of the slices, they run first, side by side."""
    long = [item for item in items if item.get_closest_marker("long") is not None]
    if not long or workers < 2:
        return
    rest = [item for item in items if item.get_closest_marker("long") is None]
    ordered: list[pytest.Item] = []
    for worker in range(workers):
        share = len(items) // workers if worker < workers - 1 else len(items)
        heads = long[worker::workers]
        take = max(0, share - len(heads))
        ordered += heads + rest[:take]
        rest = rest[take:]
    items[:] = ordered + rest


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without any DLRover/torchelastic (or torch compile-cache)
    variables leaking in."""
    env = {
        k: v
        for k, v in os.environ.items()
        # TORCHINDUCTOR_*/TRITON_*: torch sets TORCHINDUCTOR_CACHE_DIR in the process that
        # compiled something (an earlier test of this worker); a job must not inherit it.
        if not k.startswith(("DLROVER_", "TORCHELASTIC_", "TORCHINDUCTOR_", "TRITON_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["DLROVER_HOME"] = TEST_HOME
    env.update(extra)
    return env


def small_tmpfs(where: Path, size: str) -> None:
    """Make ``where`` and mount a tmpfs of ``size`` there, or skip the test (root only)."""
    where.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {made.stderr.decode()}")


def run_cmd(module: str) -> list[str]:
    return [sys.executable, "-m", module]


def free_port() -> int:
    """A port nothing listens on now (a test that needs to know it before a server starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dlrover_run(
    args: Sequence[str], env: dict[str, str] | None = None, timeout: float = 120, cwd: Path = REPO
) -> subprocess.CompletedProcess[str]:
    """``dlrover-run ARGS``; a run past ``timeout`` fails the test with the end of its output
    (where it stopped), not only the command line."""
    with subprocess.Popen(
        [*run_cmd("dlrover.cli.run"), *args],
        env=env or clean_env(),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            report = process_report()  # before the kill: what each process was doing
            proc.kill()
            stdout, stderr = proc.communicate()
            tail = "\n".join(text[-6000:] for text in (stdout, stderr) if text)
            raise AssertionError(
                f"dlrover-run did not end within {timeout:g}s; its output:\n{tail}\n{report}"
            ) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def dlrover_cli(
    home: Path, *args: str, timeout: float = 60, **env: str
) -> subprocess.CompletedProcess[str]:
    """``dlrover ARGS`` (submit, status, diagnose, stop) with $DLROVER_HOME at ``home``."""
    return subprocess.run(
        [*run_cmd("dlrover.cli.job"), *args],
        env=clean_env(DLROVER_HOME=str(home), **env),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


class MasterProcess:
    """A real dlrover-master on port 0; its address and token are read from --write-env."""

    def __init__(self, tmp: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.env_file = tmp / "master.env"
        self.log = open(tmp / "master.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                *run_cmd("dlrover.cli.master"),
                "--port",
                "0",
                "--write-env",
                str(self.env_file),
                *extra,
            ],
            # Its scratch state (no --state-db) in the test's folder: close() kills it, so it
            # never removes that folder itself.
            env=env if env is not None else clean_env(TMPDIR=str(tmp)),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 30
        while not self.env_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"dlrover-master did not start: {(tmp / 'master.log').read_text()}"
                )
            time.sleep(0.02)
        self.vars = dict(
            line.split("=", 1) for line in self.env_file.read_text().splitlines() if "=" in line
        )

    def wait(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MasterProcess]:
    m = MasterProcess(tmp_path)
    try:
        yield m
    finally:
        m.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A real redis-server on loopback, append-only with fsync on every write (the durability
    the master's StateStore promises); `restart()` keeps its data directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        import redis

        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.directory),
                "--appendonly",
                "yes",
                "--appendfsync",
                "always",
                "--save",
                "",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:  # the server is another process: ask until it answers (bounded)
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.02)
        client.close()

    def restart(self) -> None:
        self.stop()
        self.start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def redis_missing() -> str:
    """Why Redis tests cannot run here, or "" when they can."""
    import importlib.util
    import shutil

    if shutil.which("redis-server") is None:
        return "redis-server is not installed (apt-get install redis-server)"
    if importlib.util.find_spec("redis") is None:
        return "the redis package is not installed (pip install 'dlrover[redis]')"
    return ""


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    directory = tmp_path / "redis"
    directory.mkdir()
    server = RedisServer(directory)
    try:
        yield server
    finally:
        server.stop()
