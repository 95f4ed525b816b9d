"""Fault injection and process helpers for the flash-checkpoint tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from dlrover.checkpoint.config import ENV_CHECKPOINT_SOCKET
from dlrover.checkpoint.saver import CheckpointSaver

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
    module: str, args: list[str], envs: list[dict[str, str]], *, kill_at_rank: int | None = None,
    timeout: float = 180.0,
) -> None:  # fmt: skip
    """Run ``python -m module *args`` once per env (one per rank) to completion and fail with
    their output if any fails. ``kill_at_rank``: that rank SIGKILLs itself; the others, waiting
    for it in a collective, are killed once it is gone."""
    procs = [
        subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for env in envs
    ]  # fmt: skip
    outputs: list[str] = []
    try:
        if kill_at_rank is not None:
            procs[kill_at_rank].wait(timeout)
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        outputs = [proc.communicate(timeout=timeout)[0].decode() for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    if kill_at_rank is not None:
        killed = procs[kill_at_rank]
        assert killed.returncode == -signal.SIGKILL, outputs[kill_at_rank][-3000:]
        return
    for proc, text in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, text[-5000:]
