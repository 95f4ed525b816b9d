"""Real worker processes against one master: SIGKILL a worker mid-shard, nothing is lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.server import MasterServer
from dlrover.master.state_store import MemoryStateStore
from dlrover.sharding import DatasetSpec

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def wait_for(path: Path, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s}s for {what}")
        time.sleep(0.01)


@pytest.mark.slow
def test_sigkill_mid_shard_every_sample_trained_at_least_once(tmp_path: Path) -> None:
    server = MasterServer(JobMaster(JobMasterConfig(), MemoryStateStore()), "t", "127.0.0.1", 0)
    server.start()
    address = f"127.0.0.1:{server.port}"
    spec = DatasetSpec("d", size=3_000, shard_size=50, shuffle=True, seed=11)
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def start(worker_id: str, *extra: str) -> subprocess.Popen[bytes]:
        command = [
            sys.executable,
            str(HERE / "shard_worker.py"),
            "--master",
            address,
            "--worker-id",
            worker_id,
            "--spec",
            json.dumps(spec.to_dict()),
            "--out",
            str(tmp_path / f"{worker_id.replace('/', '_')}.txt"),
            *extra,
        ]
        return subprocess.Popen(command, env={**env, "DLROVER_JOB_TOKEN": "t"})

    victim = start("n0/0", "--hang-after", "20")
    survivors: list[subprocess.Popen[bytes]] = []
    try:
        wait_for(tmp_path / "n0_0.txt.hung", 20.0, "the victim to reach the middle of a shard")
        survivors += [start(f"n{i}/0", "--sample-s", "0.0002") for i in (1, 2)]
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(10.0) == -signal.SIGKILL
        # What the agent does when its worker dies: tell the master, which requeues at the head.
        assert server.job.sharding.recover_node("n0") >= 1
        for process in survivors:
            assert process.wait(30.0) == 0
    finally:
        for process in [victim, *survivors]:
            if process.poll() is None:
                process.kill()
        server.stop(0.1)
    counts: Counter[int] = Counter()
    for name in ("n0_0", "n1_0", "n2_0"):
        counts.update(int(line) for line in (tmp_path / f"{name}.txt").read_text().split())
    assert set(counts) == set(range(3_000)), "a sample was never trained"
    assert sum(counts.values()) == 3_000 + 20  # only the killed shard's first 20 were redone
    # (the server is stopped; its manager still holds the final state)
    assert server.job.sharding.manager.dataset_progress("d").finished
