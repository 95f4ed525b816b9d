"""Dynamic sharding through the real master: a worker killed mid-shard loses no sample."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pytest

from dlrover.client.sharding import connect
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.server import MasterServer
from dlrover.master.state_store import MemoryStateStore
from dlrover.sharding.errors import DatasetConflictError
from dlrover.sharding.types import DatasetSpec
from tests.conftest import SCRIPTS, clean_env, dlrover_run


@pytest.mark.e2e
def test_worker_killed_mid_shard_every_sample_is_still_trained(tmp_path: Path):
    n = 400
    r = dlrover_run(
        [
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            str(SCRIPTS / "shard_reader.py"),
            str(tmp_path),
            str(n),
            "25",
        ],
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    seen: Counter[int] = Counter()
    for f in tmp_path.glob("seen.*"):
        seen.update(int(x) for x in f.read_text().split())
    assert set(seen) == set(range(n))
    # The killed worker's partly read shard is read again, but not the whole dataset.
    assert sum(seen.values()) < 2 * n
    assert (tmp_path / "seen.0.1").read_text().count("\n") == 25


def test_many_concurrent_grpc_clients_never_share_a_leased_shard():
    server = MasterServer(JobMaster(JobMasterConfig(), MemoryStateStore()), "t", "127.0.0.1", 0)
    server.start()
    try:
        addr = f"127.0.0.1:{server.port}"
        spec = DatasetSpec(name="d", size=6400, shard_size=10)
        connect(addr, "t").register_dataset(spec)
        leased: list[list[int]] = [[] for _ in range(32)]

        def worker(i: int) -> None:
            transport = connect(addr, "t")
            while True:
                result = transport.fetch_shards("d", f"w{i}", 2)
                if result.finished or not result.shards:
                    return
                leased[i].extend(s.id.index for s in result.shards)
                transport.report_done("d", f"w{i}", [s.id for s in result.shards])

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        every = [x for part in leased for x in part]
        assert sorted(every) == list(range(640))  # each shard handed out exactly once
        again = connect(addr, "t")
        assert not again.register_dataset(spec).created  # re-registering resets nothing
        assert again.dataset_progress("d").finished
        try:
            again.register_dataset(DatasetSpec(name="d", size=10, shard_size=10))
        except DatasetConflictError as e:
            assert "already registered" in str(e)
        else:
            raise AssertionError("a conflicting registration must be refused")
    finally:
        server.stop(0.1)


@pytest.mark.e2e
def test_rank0_only_sampler_state_dict_never_blocks_and_loses_no_sample(tmp_path: Path):
    """The DLRover-style `if rank == 0: torch.save({"sampler": sampler.state_dict(...)})`: no
    collective inside, so it cannot deadlock; rank 1 is SIGKILLed mid-epoch, the job resumes
    from rank 0's checkpoint and every sample is trained at least once."""
    n, batch = 600, 4
    once = tmp_path / "fault.once"
    env = clean_env(DLROVER_FAULTS=f"kill:rank=1:step=20:once={once}")
    r = dlrover_run(
        [
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            str(SCRIPTS / "rank0_sampler_ckpt.py"),
            str(tmp_path),
            str(n),
            str(batch),
        ],
        env=env,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "dlrover fault injection: kill rank 1 step 20" in r.stderr
    assert (tmp_path / "ckpt.pt").exists()
    seen: Counter[int] = Counter()
    for f in tmp_path.glob("ids.*"):
        seen.update(int(x) for x in f.read_text().split())
    assert set(seen) == set(range(n)), sorted(set(range(n)) - set(seen))[:20]
    after_restart = sum(len(f.read_text().split()) for f in tmp_path.glob("ids.*.1"))
    # The restart resumed from the checkpoint: it did not train the whole dataset again.
    assert after_restart < n


@pytest.mark.e2e
@pytest.mark.parametrize(
    "rank,step,resumed_epoch",
    [
        (1, 55, 1),  # mid-epoch 1
        # Near the end of epoch 0: the restored pass (14 samples) ends in a short batch.
        (0, 38, 0),
    ],
)
def test_ddp_without_join_over_epochs_survives_a_kill_and_trains_every_sample(
    tmp_path: Path, rank: int, step: int, resumed_epoch: int
):
    """DynamicShardSampler in a DDP loop with no Join: every rank gets len(loader) batches each
    epoch, so nobody waits in an all-reduce. One rank is SIGKILLed; the job restarts from rank
    0's checkpoint, finishes (no hang), and every sample of every epoch is trained."""
    n, batch, epochs = 300, 4, 3
    once = tmp_path / "fault.once"
    # 300 samples in shards of 7, 2 ranks: 22 shards, 154 samples, 39 batches per rank and epoch;
    # rank 0 saves every 4 steps.
    env = clean_env(DLROVER_FAULTS=f"kill:rank={rank}:step={step}:once={once}")
    r = dlrover_run(
        [
            "--standalone",
            "--nproc_per_node=2",
            "--max-restarts=2",
            str(SCRIPTS / "lockstep_ddp.py"),
            str(tmp_path),
            str(n),
            str(batch),
            str(epochs),
        ],
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert f"dlrover fault injection: kill rank {rank} step {step}" in r.stderr
    for epoch in range(epochs):
        seen: set[int] = set()
        for f in tmp_path.glob(f"ids.{epoch}.*"):
            seen.update(int(x) for x in f.read_text().split())
        assert seen == set(range(n)), f"epoch {epoch}: {sorted(set(range(n)) - seen)[:20]}"
    batches: dict[tuple[str, str], dict[str, str]] = {}  # (epoch, restart) -> rank -> counts
    for f in tmp_path.glob("batches.*"):
        _, epoch_, rank, restart = f.name.split(".")
        batches.setdefault((epoch_, restart), {})[rank] = f.read_text()
    # Passes that ended: before the kill (none if it hit epoch 0) and after the restart.
    assert {restart for _, restart in batches} == ({"0", "1"} if resumed_epoch else {"1"})
    for (epoch_, restart), by_rank in batches.items():
        # Both ranks finished the pass with the same number of batches, len(loader)'s.
        assert set(by_rank) == {"0", "1"}, (epoch_, restart, by_rank)
        done, expected = by_rank["0"].split()
        assert done == expected and by_rank["1"] == by_rank["0"], (epoch_, restart, by_rank)
    # The restart resumed from the checkpoint: epochs before it were not trained again.
    resumed = {int(f.name.split(".")[1]) for f in tmp_path.glob("ids.*.*.1")}
    assert min(resumed) == resumed_epoch
