"""DLRover's ``megatron_dist_ckpt`` drop-ins with a distributed optimizer (each data-parallel rank
holds its own shard of the optimizer state): called with training.py's arguments under
dlrover-run, a rank SIGKILLed after a memory save resumes every shard from memory and ends where
the failure-free run ends; storage holds Megatron-LM's model file and one part per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.checkpoint.harness import without_tensorflow
from tests.conftest import SCRIPTS, clean_env, dlrover_run

SCRIPT = str(SCRIPTS / "megatron_dist_loop.py")
KILL_AT = 4


def _run(out: Path, *args: str) -> None:
    out.mkdir()
    r = dlrover_run(
        ["--standalone", "--nproc_per_node=2", "--max-restarts=1", SCRIPT, str(out), *args],
        env=without_tensorflow(clean_env()),
    )
    assert r.returncode == 0, r.stderr[-4000:]


@pytest.mark.e2e
def test_each_rank_resumes_its_optimizer_shard_from_memory(tmp_path: Path) -> None:
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    _run(reference)
    _run(killed, "--kill-at", str(KILL_AT))
    for rank in (0, 1):
        start = json.loads((killed / f"start_{rank}_1.json").read_text())
        assert start == {"iteration": KILL_AT, "source": "memory"}, (rank, start)
        ours = torch.load(killed / f"final_{rank}.pt")
        theirs = torch.load(reference / f"final_{rank}.pt")
        for part in ("model", "shard"):
            assert ours[part].keys() == theirs[part].keys()
            for key in ours[part]:
                torch.testing.assert_close(ours[part][key], theirs[part][key], rtol=0, atol=0)
    # Storage: Megatron-LM's model file from data-parallel rank 0, one optimizer part per rank.
    step = killed / "ckpt" / "iter_0000003"
    saved = torch.load(step / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert saved["iteration"] == 3 and saved["optimizer"] == {"t": 3, "lr": 0.01}
    assert saved["args"].use_distributed_optimizer
    assert not (step / "mp_rank_01").exists()
    for rank in (0, 1):
        part = torch.load(step / f"rank_{rank:05d}" / "distrib_optim.pt")
        want = torch.load(killed / f"shard3_{rank}.pt")
        assert part.keys() == want.keys() == {"param", "exp_avg", "exp_avg_sq"}
        for key in part:
            torch.testing.assert_close(part[key], want[key], rtol=0, atol=0)
