"""The zygote forks real workers: a fresh `python script.py` in effect, fast exits, no orphans."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlrover.agent.bootstrap import request_stack_dump
from dlrover.agent.error_file import read_error_file
from dlrover.agent.zygote import WorkerHandle, Zygote, ZygoteError, with_package_on_path
from dlrover.testing.launch import WorkerLauncher, spawn_popen, wait_any

REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 20.0


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    started = Zygote.start(timeout=120)
    yield started
    started.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purpose.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, deadline_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while _alive(pid):
        assert time.monotonic() < deadline, f"process {pid} still alive after {deadline_s} s"
        time.sleep(0.02)


def _wait_for_line(path: Path, deadline_s: float = DEADLINE_S) -> str:
    deadline = time.monotonic() + deadline_s
    while not path.exists() or not path.read_text().endswith("\n"):
        assert time.monotonic() < deadline, f"nothing written to {path} in {deadline_s} s"
        time.sleep(0.01)
    return path.read_text()


def _spawn(
    zygote: Zygote, tmp_path: Path, body: str, args: tuple[str, ...] = (), **env: str
) -> tuple[WorkerHandle, Path, Path]:
    script = tmp_path / "worker.py"
    script.write_text(body)
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    worker_env = {"PATH": os.environ.get("PATH", ""), "RANK": "1", **env}
    handle = zygote.spawn([str(script), *args], worker_env, tmp_path, out, err)
    return handle, out, err


def test_worker_sees_a_fresh_interpreter(zygote: Zygote, tmp_path: Path) -> None:
    library = tmp_path / "lib"
    library.mkdir()
    (library / "helper_for_zygote_test.py").write_text("VALUE = 42\n")
    body = (
        "import json, os, sys, torch\n"
        "import helper_for_zygote_test as helper\n"
        "print(json.dumps({'name': __name__, 'argv': sys.argv, 'cwd': os.getcwd(),\n"
        "  'path0': sys.path[0], 'env': sorted(os.environ), 'threads': torch.get_num_threads(),\n"
        "  'helper': helper.VALUE, 'pgid': os.getpgid(0) == os.getpid(),\n"
        "  'cuda': torch.cuda.is_initialized()}))\n"
        "print('to stderr', file=sys.stderr)\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    handle, out, err = _spawn(
        zygote, tmp_path, body, ("7",), OMP_NUM_THREADS="1", PYTHONPATH=str(library)
    )
    assert handle.forked
    assert handle.wait(DEADLINE_S) == 7
    seen = json.loads(out.read_text())
    assert seen == {
        "name": "__main__",
        "argv": [str(tmp_path / "worker.py"), "7"],
        "cwd": str(tmp_path),
        "path0": str(tmp_path),
        "env": ["OMP_NUM_THREADS", "PATH", "PYTHONPATH", "RANK"],
        "threads": 1,
        "helper": 42,
        "pgid": True,
        "cuda": False,
    }
    assert err.read_text() == "to stderr\n"


_FORK_AFTER_PRELOAD = """
import os, sys, time
import torch
from dlrover.agent.zygote_server import preload_at_priority

sys.path.insert(0, sys.argv[1])
torch.set_num_threads(1)
hung = 0
for attempt in range(int(sys.argv[2])):
    sys.modules.pop("uses_mkl", None)
    preload_at_priority(["uses_mkl"])  # its thread ran a matrix product, then ended
    pid = os.fork()
    if pid == 0:
        a = torch.randn(200, 200)
        os._exit(0 if bool(torch.isfinite(a @ a).all()) else 3)
    deadline = time.monotonic() + 20
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            hung += 1
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            break
        time.sleep(0.005)
print(hung)
"""


def test_a_fork_after_the_preload_never_inherits_mkls_lock(tmp_path: Path) -> None:
    """The preload thread's native exit runs MKL's thread-exit hook, which takes MKL's allocator
    lock after Python's join has returned. A fork in that window left the worker spinning on
    the lock for ever in its first matrix product (2 in 5 forks here before the zygote waited
    for the thread to end natively). Twenty preload-then-fork rounds: no child may hang."""
    (tmp_path / "uses_mkl.py").write_text(
        "import torch\na = torch.randn(200, 200)\nassert (a @ a).shape == (200, 200)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", _FORK_AFTER_PRELOAD, str(tmp_path), "20"],
        env=with_package_on_path(dict(os.environ)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0"]


def test_exception_exit_code_and_error_file(zygote: Zygote, tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    handle, _, err = _spawn(
        zygote,
        tmp_path,
        "def main():\n    raise KeyError('no shard')\nmain()\n",
        TORCHELASTIC_ERROR_FILE=str(error_file),
    )
    assert handle.wait(DEADLINE_S) == 1
    assert "KeyError: 'no shard'" in err.read_text()
    record = read_error_file(error_file)
    assert record is not None
    assert (record.exception_type, record.rank, record.pid) == ("KeyError", 1, handle.pid)
    assert record.location == f"{tmp_path / 'worker.py'}:2 in main"


def test_exit_is_reported_in_well_under_a_second(zygote: Zygote, tmp_path: Path) -> None:
    body = "import os, time\nprint(time.time(), flush=True)\nos._exit(3)\n"
    handle, out, _ = _spawn(zygote, tmp_path, body)
    exited = wait_any([handle], DEADLINE_S)
    noticed = time.time()
    assert exited == [handle] and handle.poll() == 3
    latency = noticed - float(out.read_text())
    assert latency < 0.5, f"exit noticed {latency:.3f} s after it happened"


def test_kill_reaches_the_whole_process_group(zygote: Zygote, tmp_path: Path) -> None:
    body = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    handle, out, _ = _spawn(zygote, tmp_path, body)
    grandchild = int(_wait_for_line(out))
    assert _alive(grandchild)
    for _ in range(3):  # a monitor loop's repeated short waits
        assert wait_any([handle], 0.01) == []
    handle.kill(signal.SIGKILL)
    assert handle.wait(DEADLINE_S) == -signal.SIGKILL
    _wait_gone(grandchild)


def test_spawn_refused_with_a_clear_reason(zygote: Zygote, tmp_path: Path) -> None:
    with pytest.raises(ZygoteError, match="cwd .*missing.* is not a directory"):
        zygote.spawn(["x.py"], {}, tmp_path / "missing", tmp_path / "o", tmp_path / "e")
    handle, _, err = _spawn(zygote, tmp_path, "")
    assert handle.wait(DEADLINE_S) == 0
    missing = zygote.spawn(["nope.py"], {}, tmp_path, tmp_path / "o", tmp_path / "e2")
    assert missing.wait(DEADLINE_S) == 2
    assert "can't open file 'nope.py'" in (tmp_path / "e2").read_text()


def test_bad_preload_fails_fast_and_launcher_falls_back(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(ZygoteError, match="did not become ready"):
        Zygote.start(preload=["no_such_module_for_dlrover"], timeout=60)
    assert time.monotonic() - started < 30
    launcher = WorkerLauncher(preload=["no_such_module_for_dlrover"])
    try:
        assert launcher.zygote is None
        script = tmp_path / "w.py"
        script.write_text("import sys\nprint(sys.argv[1:], __name__)\nsys.exit(4)\n")
        handle = launcher.spawn(
            [str(script), "a"], dict(os.environ), tmp_path, tmp_path / "o", tmp_path / "e"
        )
        assert not handle.forked
        assert handle.wait(DEADLINE_S) == 4
        assert (tmp_path / "o").read_text() == "['a'] __main__\n"
    finally:
        launcher.close()


def test_popen_worker_kill_and_group(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    handle = spawn_popen([str(script)], dict(os.environ), tmp_path, tmp_path / "o", tmp_path / "e")
    _wait_for_line(tmp_path / "o")
    handle.kill(signal.SIGTERM)
    assert handle.wait(DEADLINE_S) == -signal.SIGTERM


AGENT = """
import os, sys, time
from dlrover.agent.zygote import Zygote
zygote = Zygote.start(preload=["json"], timeout=60)
script, tmp = sys.argv[1], sys.argv[2]
worker = zygote.spawn([script], dict(os.environ), tmp, tmp + "/wo", tmp + "/we")
print(zygote.pid, worker.pid, flush=True)
time.sleep(600)
"""


def test_workers_die_with_the_agent(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text("import time\ntime.sleep(600)\n")
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(script), str(tmp_path)],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert agent.stdout is not None
        zygote_pid, worker_pid = map(int, agent.stdout.readline().split())
        assert _alive(zygote_pid) and _alive(worker_pid)
        agent.kill()
        agent.wait(DEADLINE_S)
        _wait_gone(zygote_pid)
        _wait_gone(worker_pid)
    finally:
        agent.kill()
        agent.wait(DEADLINE_S)


def test_zygote_death_resolves_handles(tmp_path: Path) -> None:
    own = Zygote.start(preload=["json"], timeout=60)
    try:
        script = tmp_path / "w.py"
        script.write_text("import time\ntime.sleep(600)\n")
        handle = own.spawn([str(script)], {}, tmp_path, tmp_path / "o", tmp_path / "e")
        os.kill(own.pid, signal.SIGKILL)
        assert handle.wait(DEADLINE_S) == -signal.SIGKILL
        _wait_gone(handle.pid)
        assert not own.alive
        with pytest.raises(ZygoteError, match="gone"):
            own.spawn([str(script)], {}, tmp_path, tmp_path / "o", tmp_path / "e")
    finally:
        own.close()


DDP_TRAIN = """
import os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)))
optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
generator = torch.Generator().manual_seed(dist.get_rank())
for _ in range(5):
    optimizer.zero_grad()
    model(torch.randn(4, 8, generator=generator)).pow(2).mean().backward()
    optimizer.step()
from dlrover.testing.digest import tensors_digest
print(tensors_digest(model.parameters()), flush=True)
dist.destroy_process_group()
os._exit(0)  # torch+gloo can abort during interpreter shutdown, whatever the launcher
"""


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _train_two_ranks(spawn: object, tmp_path: Path, tag: str) -> list[str]:
    script = tmp_path / "train.py"
    script.write_text(DDP_TRAIN)
    port = _free_port()
    handles: list[WorkerHandle] = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        out, err = tmp_path / f"{tag}{rank}.out", tmp_path / f"{tag}{rank}.err"
        handles.append(spawn([str(script)], env, tmp_path, out, err))  # type: ignore[operator]
    for rank, handle in enumerate(handles):
        assert handle.wait(60) == 0, (tmp_path / f"{tag}{rank}.err").read_text()
    return [(tmp_path / f"{tag}{rank}.out").read_text() for rank in range(2)]


@pytest.mark.e2e
def test_forked_ddp_training_equals_popen_bit_for_bit(zygote: Zygote, tmp_path: Path) -> None:
    forked = _train_two_ranks(zygote.spawn, tmp_path, "forked")
    fresh = _train_two_ranks(spawn_popen, tmp_path, "fresh")
    assert forked[0] == forked[1] == fresh[0] == fresh[1]
    assert len(forked[0].strip()) == 64


def test_default_thread_count_matches_a_fresh_interpreter(zygote: Zygote, tmp_path: Path) -> None:
    body = "import torch\nprint(torch.get_num_threads())\n"
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    fresh = subprocess.run(
        [sys.executable, "-c", body], env=env, capture_output=True, text=True, timeout=60
    )
    script = tmp_path / "threads.py"
    script.write_text(body)
    handle = zygote.spawn([str(script)], env, tmp_path, tmp_path / "o", tmp_path / "e")
    assert handle.wait(DEADLINE_S) == 0
    assert (tmp_path / "o").read_text() == fresh.stdout


def test_forked_worker_dumps_stacks_on_request(zygote: Zygote, tmp_path: Path) -> None:
    body = (
        "import time\n"
        "def waiting_for_peers():\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(600)\n"
        "waiting_for_peers()\n"
    )
    handle, out, err = _spawn(zygote, tmp_path, body)
    assert _wait_for_line(out) == "ready\n"
    assert request_stack_dump(handle.pid)
    deadline = time.monotonic() + DEADLINE_S
    while "waiting_for_peers" not in err.read_text():
        assert time.monotonic() < deadline, "no stack dump"
        time.sleep(0.02)
    assert handle.poll() is None  # the dump does not end the worker
    handle.kill()
    assert handle.wait(DEADLINE_S) == -signal.SIGKILL
    assert f'File "{tmp_path / "worker.py"}", line 4 in waiting_for_peers' in err.read_text()


STDIO_PROBE = (
    "import sys\n"
    "def describe(stream):\n"
    "    return (type(stream.buffer).__name__, stream.line_buffering, stream.write_through,\n"
    "            stream.encoding, stream.errors)\n"
    "print(repr([describe(sys.stdout), describe(sys.stderr)]), file=sys.stderr)\n"
)


@pytest.mark.parametrize(
    ("flag", "env"),
    [("-u", {}), ("", {"PYTHONUNBUFFERED": "1"}), ("", {})],
    ids=["-u", "PYTHONUNBUFFERED", "buffered"],
)
def test_stdio_is_set_up_as_in_a_fresh_interpreter(
    zygote: Zygote, tmp_path: Path, flag: str, env: dict[str, str]
) -> None:
    script = tmp_path / "probe.py"
    script.write_text(STDIO_PROBE)
    base = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    with open(tmp_path / "fresh.out", "wb") as out:
        fresh = subprocess.run(
            [sys.executable, *([flag] if flag else []), str(script)],
            env={**base, **env},
            stdout=out,
            capture_output=False,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    handle = zygote.spawn(
        [str(script)],
        {**base, **env},
        tmp_path,
        tmp_path / "o",
        tmp_path / "e",
        unbuffered=bool(flag),
    )
    assert handle.wait(DEADLINE_S) == 0
    assert (tmp_path / "e").read_text() == fresh.stderr


def test_last_line_before_a_hang_is_visible(zygote: Zygote, tmp_path: Path) -> None:
    # `python -u`: the line is in the file at once although the worker never flushes or exits.
    body = "import time\nprint('last words before the hang')\ntime.sleep(600)\n"
    script = tmp_path / "hang.py"
    script.write_text(body)
    handle = zygote.spawn(
        [str(script)], {"PATH": ""}, tmp_path, tmp_path / "o", tmp_path / "e", unbuffered=True
    )
    assert _wait_for_line(tmp_path / "o") == "last words before the hang\n"
    assert handle.poll() is None
    handle.kill()
    assert handle.wait(DEADLINE_S) == -signal.SIGKILL


def test_worker_shares_the_callers_open_file(zygote: Zygote, tmp_path: Path) -> None:
    """`dlrover-run > file`: the file is opened with O_TRUNC and without O_APPEND, so only a
    shared offset keeps the caller's and the worker's lines from overwriting each other."""
    body = "import sys\nfor i in range(5):\n    print('worker', i)\nprint('worker err', file=sys.stderr)\n"
    script = tmp_path / "lines.py"
    script.write_text(body)
    path = tmp_path / "console.txt"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"caller before\n")
        handle = zygote.spawn([str(script)], {"PATH": ""}, tmp_path, fd, fd, unbuffered=True)
        assert handle.wait(DEADLINE_S) == 0
        os.write(fd, b"caller after\n")
    finally:
        os.close(fd)
    expected = ["caller before", *(f"worker {i}" for i in range(5)), "worker err", "caller after"]
    assert path.read_text().splitlines() == expected


def test_spawn_with_an_unwritable_output_is_refused(zygote: Zygote, tmp_path: Path) -> None:
    with pytest.raises(ZygoteError, match="cannot open the worker's output: .*No such file"):
        zygote.spawn(["x.py"], {}, tmp_path, tmp_path / "no" / "o", tmp_path / "e")
    assert zygote.alive
