"""A node whose master is gone for good stops its workers and exits, keeping its newest step."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from dlrover.constants import EXIT_MASTER_LOST
from dlrover.processes import pid_alive
from tests.conftest import SCRIPTS, MasterProcess, clean_env, run_cmd

pytestmark = pytest.mark.e2e


def _steps(out: Path) -> list[int]:
    path = Path(f"{out}.steps")
    lines = path.read_text().split("\n") if path.exists() else []
    return [int(x) for x in lines if x.isdigit()]


def test_a_node_whose_master_is_gone_stops_its_workers_and_persists_its_newest_step(
    tmp_path: Path, master: MasterProcess
) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "train"
    ckpt.mkdir()
    log = open(tmp_path / "node.log", "w+")  # noqa: SIM115
    node = subprocess.Popen(
        [
            *run_cmd("dlrover.cli.run"),
            "--nnodes=1",
            "--nproc-per-node=2",
            "--master-lost-timeout=3",
            str(SCRIPTS / "flash_train.py"),
            "--steps=100000",
            "--disk-every=100000",  # memory saves only: storage gets the step only at the end
            "--step-time=0.02",
            f"--ckpt={ckpt}",
            f"--out={out}",
        ],
        env=clean_env(**master.vars),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while len(_steps(out)) < 5:
            assert node.poll() is None, (tmp_path / "node.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "no training step within 120 s"
            time.sleep(0.1)
        workers = [int(p) for p in _worker_pids(node.pid)]
        assert len(workers) == 2, workers
        os.kill(master.proc.pid, signal.SIGKILL)
        master.proc.wait(10)
        # 3 s of unanswered heartbeats (one every 2 s), then the stop and the persist.
        node.wait(90)
    finally:
        if node.poll() is None:
            node.kill()
            node.wait(10)
        log.close()
    output = (tmp_path / "node.log").read_text()
    assert node.returncode == EXIT_MASTER_LOST, output[-4000:]
    assert "answered no heartbeat for 3s (--master-lost-timeout)" in output, output[-4000:]
    assert not [pid for pid in workers if pid_alive(pid)], "workers outlived their node"
    # The newest in-memory step is on storage: the last one rank 0 finished, or the one it
    # had saved when it was stopped before noting it.
    last = _steps(out)[-1]
    assert int((ckpt / "latest").read_text()) in (last, last + 1), (last, output[-3000:])


def _worker_pids(agent_pid: int) -> list[str]:
    """The agent's worker processes: its children that run the script, or the children of its
    zygote (forked workers keep the zygote's command line)."""

    def children(pid: str) -> list[str]:
        return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()

    def cmdline(pid: str) -> bytes:
        return Path(f"/proc/{pid}/cmdline").read_bytes()

    workers = []
    for pid in children(str(agent_pid)):
        if b"dlrover.agent.zygote_server" in cmdline(pid):
            workers.extend(children(pid))
        elif b"flash_train.py" in cmdline(pid):
            workers.append(pid)
    return workers
