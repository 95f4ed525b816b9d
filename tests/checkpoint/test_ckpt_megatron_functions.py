"""DLRover's Megatron-LM drop-ins (``save_checkpoint``/``load_checkpoint`` of
``dlrover.trainer.torch.flash_checkpoint.megatron``) in a Megatron-LM style loop: directories
from Megatron-LM's arguments, the model as a list of one chunk, Megatron-LM's file layout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoint.harness import without_tensorflow
from tests.conftest import REPO, SCRIPTS, clean_env, dlrover_run

SCRIPT = str(SCRIPTS / "megatron_loop.py")


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.e2e
@pytest.mark.parametrize("style", ["dlrover", "today"])
def test_megatron_drop_ins_save_in_megatrons_layout_and_load_memory_then_storage(
    tmp_path: Path, style: str
) -> None:
    """``dlrover``: the calls of DLRover's documents; ``today``: exactly the arguments of
    Megatron-LM's training.py today (its non-persistent save goes to memory only)."""
    r = dlrover_run(
        ["--standalone", "--nproc_per_node=1", "--max-restarts=1", SCRIPT, str(tmp_path), "train",
         style], env=without_tensorflow(clean_env()),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    ckpt = tmp_path / "ckpt"
    # The restarted attempt: iteration 4 from the agent's memory, with its FLOPs count.
    restarted = torch.load(tmp_path / "restarted.pt")
    assert (restarted["iteration"], restarted["flops"]) == (4, 4000.0)
    assert _same(restarted["model"], torch.load(tmp_path / "state4.pt"))
    if style == "today":  # from the file's args: 2+4+8+8 samples, not 4 x the batch size
        assert restarted["consumed"] == 22
    # On storage, in Megatron-LM's layout, readable by torch.load: the DISK save of iteration 3,
    # and 4, which the agent persisted from memory after the failure.
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    for iteration in (3, 4):
        path = ckpt / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt"
        saved = torch.load(path, weights_only=False)
        assert saved["iteration"] == iteration
        assert saved["num_floating_point_operations_so_far"] == 1000.0 * iteration
        assert _same(saved["model"], torch.load(tmp_path / f"state{iteration}.pt"))
        assert {"optimizer", "opt_param_scheduler", "rng_state", "checkpoint_version"} <= set(saved)
        if style == "today":
            assert saved["args"].consumed_train_samples == {3: 14, 4: 22}[iteration]
            assert saved["dataloader_state"] == {"position": saved["args"].consumed_train_samples}
    # A new process (the job's memory is gone with it): the newest iteration on storage.
    r = subprocess.run(
        [sys.executable, SCRIPT, str(tmp_path), "load", style],
        env=without_tensorflow(clean_env()),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    loaded = torch.load(tmp_path / "loaded.pt")
    assert (loaded["iteration"], loaded["flops"]) == (4, 4000.0)
    assert _same(loaded["model"], torch.load(tmp_path / "state4.pt"))
    assert loaded["lr"] == pytest.approx([0.01 * 0.1 * 0.1])  # StepLR(2) after 4 steps
    if style == "today":
        assert loaded["consumed"] == 22
