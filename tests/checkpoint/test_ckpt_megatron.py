"""MegatronCheckpointer with megatron.core's GPT model (CPU, gloo, 2 ranks, TP or PP 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.checkpoint.harness import (
    assert_same,
    free_port,
    run_ranks,
    running_saver,
    worker_env,
)

# Each rank's start (import, process group, model) takes 10-20 s here, more on a busy machine.
pytestmark = [pytest.mark.extras, pytest.mark.slow, pytest.mark.timeout(1200)]
pytest.importorskip(
    "megatron.core", reason="megatron-core is not installed (pip install megatron-core==0.16.1)"
)

STEPS, DISK_EVERY = 6, 3


def _run(parallel: list[str], ckpt: Path, out: Path, socket_path: str,
         restart: int = 0, kill_at: int = -1) -> None:  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    envs = [worker_env(socket_path, rank, 2, port, restart) for rank in range(2)]
    args = [*parallel, f"--ckpt={ckpt}", f"--out={out}", f"--steps={STEPS}",
            f"--disk-every={DISK_EVERY}", f"--kill-at={kill_at}"]  # fmt: skip
    kill_at_rank = 1 if kill_at >= 0 else None
    run_ranks("tests.checkpoint.megatron_workers", args, envs, kill_at_rank=kill_at_rank)


@pytest.mark.parametrize(
    ("parallel", "files"),
    [
        (["--tp=2"], ["mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt"]),
        (["--pp=2"], ["mp_rank_00_000/model_optim_rng.pt", "mp_rank_00_001/model_optim_rng.pt"]),
    ],
    ids=["tp2", "pp2"],
)
def test_rank_killed_resumes_from_memory_and_files_are_megatrons(
    tmp_path: Path, parallel: list[str], files: list[str]
) -> None:
    with running_saver(tmp_path) as saver:
        _run(parallel, tmp_path / "ref-ckpt", tmp_path / "ref", saver.socket_path)
    reference = [torch.load(tmp_path / "ref" / f"final_{r}.pt") for r in range(2)]
    # Megatron-LM's layout, read back with torch.load as its loader does: one file per stage.
    ref_ckpt = tmp_path / "ref-ckpt"
    assert (ref_ckpt / "latest_checkpointed_iteration.txt").read_text() == str(STEPS)
    step_dir = ref_ckpt / f"iter_{STEPS:07d}"
    for rank, name in enumerate(files):
        content = torch.load(step_dir / name, weights_only=False)
        assert content["iteration"] == STEPS and content["checkpoint_version"] == 3.0
        assert {"model", "optimizer", "opt_param_scheduler", "rng_state"} <= set(content)
        model = {k: v for k, v in content["model"].items() if v is not None}
        assert_same(model, reference[rank])

    ckpt = tmp_path / "ckpt"
    with running_saver(tmp_path) as saver:
        _run(parallel, ckpt, tmp_path / "a", saver.socket_path, kill_at=5)
        _run(parallel, ckpt, tmp_path / "b", saver.socket_path, restart=1)
    for rank in range(2):
        loaded = json.loads((tmp_path / "b" / f"load_{rank}.json").read_text())
        assert loaded == {"source": "memory", "iteration": 4}, loaded
        assert_same(torch.load(tmp_path / "b" / f"final_{rank}.pt"), reference[rank])
