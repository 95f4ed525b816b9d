"""Real worker processes against one master: a SIGKILL mid-shard or a restart loses nothing."""

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

from dlrover.client.sharding import connect
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.server import MasterServer
from dlrover.master.state_store import MemoryStateStore
from dlrover.sharding import DatasetSpec, DeliveryMode
from dlrover.trainer.torch.elastic import DynamicShardSampler
from tests.conftest import clean_env

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def wait_for(path: Path, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s}s for {what}")
        time.sleep(0.01)


@pytest.mark.e2e
@pytest.mark.parametrize("mode", list(DeliveryMode), ids=lambda m: m.value)
def test_sigkill_mid_shard_each_mode_keeps_its_promise(tmp_path: Path, mode: DeliveryMode) -> None:
    """A worker SIGKILLed 20 samples into a shard (it reports each sample trained), beside two
    that read on. At least once: only those 20 are trained twice. Exactly once: each sample
    once. At most once: none twice, and the master's lost count is exactly the samples nobody
    trained (the rest of that shard and the shards the victim had leased ahead)."""
    server = MasterServer(JobMaster(JobMasterConfig(), MemoryStateStore()), "t", "127.0.0.1", 0)
    server.start()
    address = f"127.0.0.1:{server.port}"
    spec = DatasetSpec("d", size=3_000, shard_size=50, shuffle=True, seed=11, mode=mode)
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

    victim = start("n0/0", "--hang-after", "20", "--report-progress")
    survivors: list[subprocess.Popen[bytes]] = []
    try:
        wait_for(tmp_path / "n0_0.txt.hung", 20.0, "the victim to reach the middle of a shard")
        survivors += [start(f"n{i}/0", "--sample-s", "0.0002") for i in (1, 2)]
        victim.send_signal(signal.SIGKILL)
        assert victim.wait(10.0) == -signal.SIGKILL
        # What the agent does when its worker dies: tell the master, which requeues its shards
        # at the head (at most once: drops them).
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
    # (the server is stopped; its manager still holds the final state)
    progress = server.job.sharding.manager.dataset_progress("d")
    assert progress.finished
    if mode is DeliveryMode.AT_MOST_ONCE:
        assert set(counts.values()) == {1}, "a sample was trained twice"
        assert progress.lost_samples == 3_000 - len(counts) >= 30
        assert progress.lost_samples == 30 + 50 * (progress.lost_shards - 1)
        return
    assert progress.lost_samples == 0
    assert set(counts) == set(range(3_000)), "a sample was never trained"
    # At least once, only the killed shard's first 20 were trained again.
    redone = 20 if mode is DeliveryMode.AT_LEAST_ONCE else 0
    assert sum(counts.values()) == 3_000 + redone


@pytest.mark.e2e
def test_ranks_of_one_start_with_different_restart_counts_restore_the_position_once(
    tmp_path: Path,
) -> None:
    """Exactly-once across a restart where the nodes' restart counts differ (node 0's worker
    failed and was restarted, node 1 only re-formed the world; a replacement node starts at 0):
    rank 0 restores the checkpoint and leases and reads shards before rank 1 restores the same
    checkpoint. Rank 1's restore must not apply again: it put rank 0's leased shards back in
    the queue, rank 1 read them too, and shards left over were never read (found by
    benchmarks/fault_campaign.py: 16 samples trained twice after an agent SIGKILL)."""
    server = MasterServer(JobMaster(JobMasterConfig(), MemoryStateStore()), "t", "127.0.0.1", 0)
    server.start()
    address = f"127.0.0.1:{server.port}"
    size, shard_size, step, batch = 96, 8, 5, 4
    workers: list[subprocess.Popen[bytes]] = []
    try:
        # The first start: one rank trains 5 steps of 4 (a shard and a half) and checkpoints.
        first = DynamicShardSampler(
            range(size),
            1,
            0,
            shuffle=True,
            seed=3,
            transport=connect(address, "t"),
            dataset_name="d",
            shard_size=shard_size,
            mode=DeliveryMode.EXACTLY_ONCE,
            worker_id="n0/0",
        )
        it = iter(first)
        trained = [next(it) for _ in range(step * batch)]
        state = first.state_dict(step, batch)
        first.close()
        server.job.sharding.recover_node("n0")  # what the agent's rejoin does
        (tmp_path / "state.json").write_text(json.dumps(state))

        def start(rank: int, restart_count: int, *extra: str) -> subprocess.Popen[bytes]:
            command = [
                sys.executable,
                str(HERE / "sampler_worker.py"),
                "--size",
                str(size),
                "--shard-size",
                str(shard_size),
                "--state",
                str(tmp_path / "state.json"),
                "--out",
                str(tmp_path / f"rank{rank}.json"),
                *extra,
            ]
            env = clean_env(
                DLROVER_MASTER_ADDR=address,
                DLROVER_JOB_TOKEN="t",
                DLROVER_NODE_ID=f"n{rank}",
                DLROVER_RDZV_ROUND="2",
                TORCHELASTIC_RESTART_COUNT=str(restart_count),
                RANK=str(rank),
                LOCAL_RANK="0",
                WORLD_SIZE="2",
            )
            workers.append(subprocess.Popen(command, env=env))
            return workers[-1]

        go = tmp_path / "go"
        rank0 = start(0, 1, "--pause-after", str(shard_size), "--go", str(go))
        wait_for(tmp_path / "rank0.json.paused", 60.0, "rank 0 to restore and read a shard")
        rank1 = start(1, 0)
        assert rank1.wait(60.0) == 0
        go.write_text("go\n")
        assert rank0.wait(60.0) == 0
    finally:
        for process in workers:
            if process.poll() is None:
                process.kill()
        server.stop(0.1)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["length"] == ranks[1]["length"] == len(ranks[0]["indices"])
    counts = Counter(trained)
    for rank in ranks:
        counts.update(set(rank["indices"]))  # a rank's repeats of its own samples are padding
    lost = sorted(set(range(size)) - set(counts))
    twice = sorted(i for i, n in counts.items() if n > 1)
    assert (lost, twice) == ([], []), "samples never read, samples read twice"
