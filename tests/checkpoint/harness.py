"""Fault injection and process helpers for the flash-checkpoint tests."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from dlrover.agent.bootstrap import read_script_result
from dlrover.checkpoint.config import ENV_CHECKPOINT_SOCKET
from dlrover.checkpoint.saver import CheckpointSaver
from dlrover.constants import ENV_DONE_FILE

REPO = Path(__file__).resolve().parents[2]


def expected_state(step: int, rows: int = 64) -> dict[str, Any]:
    """A deterministic DDP-style state for ``step`` (the consistency oracle)."""
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "model": {
            "w": torch.randn(rows, 32, generator=g),
            "b": torch.randn(32, generator=g),
            "h": torch.randn(8, 8, generator=g).to(torch.bfloat16),
            "n": torch.randint(0, 100, (5,), generator=g),
        },
        "optimizer": {
            "state": {
                0: {
                    "step": torch.tensor(float(step)),
                    "exp_avg": torch.randn(rows, 32, generator=g),
                }
            },
            "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": [0]}],
        },
        "step": step,
    }


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Bit-for-bit equality of nested states (dtype, shape and every byte of each tensor)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, (path, a.dtype, b.dtype)
        assert torch.equal(_bytes_of(a), _bytes_of(b)), path
    elif isinstance(a, dict):
        assert set(a) == set(b), (path, set(a), set(b))
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}.{i}")
    else:
        assert a == b, (path, a, b)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes (so NaNs and -0.0 compare exactly)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_file(path: Path, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Wait for a marker file a child writes at a chosen instant (deadline; child death)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"child exited with {proc.returncode} before {path}:\n{out}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout} s")
        time.sleep(0.01)


@contextmanager
def running_saver(tmp: Path, **kwargs: Any) -> Iterator[CheckpointSaver]:
    """An agent-side saver in this process, its socket exported for child workers."""
    tag = uuid.uuid4().hex[:8]
    saver = CheckpointSaver(str(tmp / f"saver-{tag}.sock"), shm_prefix=f"dlrtest-{tag}", **kwargs)
    saver.start()
    try:
        yield saver
    finally:
        saver.close(unlink=True)


def worker_env(
    socket_path: str | None, rank: int = 0, world: int = 1, port: int = 0, restart: int = 0
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ENV_CHECKPOINT_SOCKET}
    env.update(
        PYTHONPATH=str(REPO),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RESTART_COUNT=str(restart),
        OMP_NUM_THREADS="1",
    )
    if socket_path:
        env[ENV_CHECKPOINT_SOCKET] = socket_path
    return env


def start_worker(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.checkpoint.workers", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def run_workers(args: list[str], envs: list[dict[str, str]], timeout: float = 60.0) -> None:
    """Run one worker per env to completion; fail with their output if any fails."""
    procs = [start_worker(args, env) for env in envs]
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outputs.append(out.decode())
    failed = [
        f"worker {p.args!r} exited {p.returncode}:\n{out}"
        for p, out in zip(procs, outputs, strict=True)
        if p.returncode != 0
    ]
    assert not failed, "\n".join(failed)


def kill(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def run_ranks(
    module: str, args: list[str], envs: list[dict[str, str]], logs: Path, *,
    kill_at_rank: int | None = None, timeout: float = 600.0,
) -> None:  # fmt: skip
    """Run ``module`` once per env (one per rank) as our agent starts a worker (through the
    bootstrap, output to ``logs/rank_<r>.log``) and fail with a rank's log if its script did
    not return 0. ``kill_at_rank``: that rank SIGKILLs itself; the others, waiting for it in a
    collective, are killed once it is gone.

    A rank is judged as the agent judges it, by what its script returned (the bootstrap's done
    file), not by the process's exit status: torch 2.13 with gloo at times aborts in interpreter
    shutdown after the script has returned ("terminate called without an active exception",
    docs/fault_tolerance.md). Such an abort is reported as a warning, with the rank's log."""
    logs.mkdir(parents=True, exist_ok=True)
    done = [logs / f"rank_{rank}.result" for rank in range(len(envs))]
    procs = []
    for rank, env in enumerate(envs):
        with (logs / f"rank_{rank}.log").open("wb") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "dlrover.agent.bootstrap", "-m", module, *args],
                    cwd=REPO, env={**env, ENV_DONE_FILE: str(done[rank])},
                    stdout=out, stderr=subprocess.STDOUT,
                )
            )  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        if kill_at_rank is not None:
            procs[kill_at_rank].wait(timeout)
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        for proc in procs:
            proc.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    def log_of(rank: int) -> str:
        return (logs / f"rank_{rank}.log").read_text(errors="replace")[-5000:]

    if kill_at_rank is not None:
        killed = procs[kill_at_rank]
        assert killed.returncode == -signal.SIGKILL, log_of(kill_at_rank)
        return
    for rank, proc in enumerate(procs):
        returned = read_script_result(str(done[rank]))
        assert returned == 0, (
            f"rank {rank}: script returned {returned}, exit {proc.returncode}:\n{log_of(rank)}"
        )
        if proc.returncode != 0:
            warnings.warn(
                f"rank {rank} of {module} returned 0 from its script, then ended with "
                f"{proc.returncode} in interpreter shutdown:\n{log_of(rank)[-1500:]}",
                stacklevel=2,
            )


NO_TENSORFLOW = Path(__file__).resolve().parent / "no_tensorflow"


def without_tensorflow(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a Megatron rank, with TensorFlow hidden (its import fails, as where it is not
    installed). CI's extras stage installs TensorFlow for the TensorFlow tests, and
    megatron-core's timers import torch.utils.tensorboard, which then imports all of it: 3.6 of
    a rank's 8.3 CPU-s to import megatron.core here. A Megatron user's environment has no
    TensorFlow; tensorboard falls back to its own stub, as it does there."""
    paths = [str(NO_TENSORFLOW), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    return {**env, "PYTHONPATH": os.pathsep.join(paths)}


def skip_without_megatron_core() -> None:
    """Skip the calling test module where megatron-core is not installed. Found, not imported:
    the test process needs none of megatron (its import takes 10-20 s here)."""
    if (
        importlib.util.find_spec("megatron") is None
        or importlib.util.find_spec("megatron.core") is None
    ):
        pytest.skip(
            "megatron-core is not installed (pip install megatron-core==0.16.1)",
            allow_module_level=True,
        )
