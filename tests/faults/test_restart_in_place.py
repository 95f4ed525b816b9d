"""The pieces together: a killed DDP rank is detected, judged and restarted from the zygote."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from dlrover.agent.error_file import first_failure, read_error_file
from dlrover.agent.failure_policy import (
    ExitKind,
    FailureAction,
    WorkerFailure,
    WorkerFailureObservation,
    decide_worker_failure,
    user_error_signature,
)
from dlrover.agent.zygote import WorkerHandle, Zygote
from dlrover.testing.launch import wait_any

REPO = Path(__file__).resolve().parents[2]
STEPS = 6

TRAIN = f"""
import os, sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from dlrover.testing.faults import maybe_inject
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range({STEPS}):
    maybe_inject(step)
    optimizer.zero_grad()
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    print("step", step, flush=True)
dist.destroy_process_group()
os._exit(0)  # torch+gloo can abort during interpreter shutdown, whatever the launcher
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start(zygote: Zygote, script: Path, attempt_dir: Path, restart: int) -> list[WorkerHandle]:
    port = _free_port()
    handles: list[WorkerHandle] = []
    for rank in range(2):
        rank_dir = attempt_dir / f"rank_{rank}"
        rank_dir.mkdir(parents=True)
        env = dict(
            os.environ,
            PYTHONPATH=str(REPO),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            TORCHELASTIC_RESTART_COUNT=str(restart),
            TORCHELASTIC_ERROR_FILE=str(rank_dir / "error.json"),
            DLROVER_FAULTS="kill:rank=1:step=3:restart=0",
        )
        out, err = rank_dir / "stdout", rank_dir / "stderr"
        handles.append(zygote.spawn([str(script)], env, script.parent, out, err))
    return handles


@pytest.mark.e2e
def test_killed_rank_is_restarted_in_place(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    zygote = Zygote.start(timeout=120)
    try:
        first = _start(zygote, script, tmp_path / "attempt_0", restart=0)
        exited = wait_any(first, timeout=60)
        assert [handle.pid for handle in exited] == [first[1].pid]
        assert first[1].poll() == -signal.SIGKILL
        # The agent stops the survivor (it would hang or fail in the collective anyway).
        first[0].kill(signal.SIGKILL)
        assert first[0].wait(10) == -signal.SIGKILL

        dead = WorkerFailure(1, ExitKind.SIGNALED, -signal.SIGKILL)
        observation = WorkerFailureObservation((dead,), restart_count=0, max_restarts=2)
        decision = decide_worker_failure(observation)
        assert decision.action is FailureAction.RESTART_PROCESSES
        assert user_error_signature((dead,)) is None
        files = {rank: tmp_path / "attempt_0" / f"rank_{rank}" / "error.json" for rank in (0, 1)}
        report = first_failure(files, {1: -signal.SIGKILL}, node="node-0")
        assert report is not None and report.rank == 1

        restarted_at = time.monotonic()
        second = _start(zygote, script, tmp_path / "attempt_1", restart=1)
        assert [handle.wait(60) for handle in second] == [0, 0]
        assert time.monotonic() - restarted_at < 60
        for rank in (0, 1):
            out = (tmp_path / "attempt_1" / f"rank_{rank}" / "stdout").read_text()
            assert out.splitlines() == [f"step {step}" for step in range(STEPS)]
            assert read_error_file(tmp_path / "attempt_1" / f"rank_{rank}" / "error.json") is None
        killed_out = (tmp_path / "attempt_0" / "rank_1" / "stdout").read_text()
        assert killed_out.splitlines() == [f"step {step}" for step in range(3)]
    finally:
        zygote.close()


@pytest.mark.e2e
def test_survivor_error_after_peer_kill_is_collateral(tmp_path: Path) -> None:
    """When a peer dies mid-collective, the survivor's error must not count as a user error."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    zygote = Zygote.start(timeout=120)
    try:
        handles = _start(zygote, script, tmp_path / "attempt_0", restart=0)
        returncodes = [handle.wait(60) for handle in handles]
        assert returncodes[1] == -signal.SIGKILL
        survivor = read_error_file(tmp_path / "attempt_0" / "rank_0" / "error.json")
        assert returncodes[0] == 1 and survivor is not None, "the survivor should fail fast"
        assert survivor.is_collateral(), f"{survivor.exception_type}: {survivor.message}"
        failures = (
            WorkerFailure(0, ExitKind.EXITED, 1, survivor),
            WorkerFailure(1, ExitKind.SIGNALED, -signal.SIGKILL),
        )
        assert user_error_signature(failures) is None
        files = {rank: tmp_path / "attempt_0" / f"rank_{rank}" / "error.json" for rank in (0, 1)}
        report = first_failure(files, {0: 1, 1: -signal.SIGKILL})
        assert report is not None and report.rank == 1
    finally:
        zygote.close()
