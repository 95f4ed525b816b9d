"""DeepSpeedCheckpointer with real DeepSpeed (CPU accelerator, gloo, 2 ranks, ZeRO 1-3)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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
pytestmark = [pytest.mark.extras, pytest.mark.slow, pytest.mark.timeout(900)]
deepspeed = pytest.importorskip(
    "deepspeed", reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed==0.19.8)"
)

STEPS, DISK_EVERY = 6, 3


def _envs(socket_path: str | None, restart: int = 0) -> list[dict[str, str]]:
    port = free_port()
    envs = [worker_env(socket_path, rank, 2, port, restart) for rank in range(2)]
    for env in envs:
        env["DS_ACCELERATOR"] = "cpu"
    return envs


def _run(mode: str, stage: int, ckpt: Path, out: Path, socket_path: str | None,
         *extra: str, restart: int = 0, expect_kill: bool = False) -> None:  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    args = [mode, f"--stage={stage}", f"--ckpt={ckpt}", f"--out={out}", f"--steps={STEPS}",
            f"--disk-every={DISK_EVERY}", *extra]  # fmt: skip
    envs = _envs(socket_path, restart)
    run_ranks("tests.checkpoint.ds_workers", args, envs, kill_at_rank=1 if expect_kill else None)


def _load_record(out: Path, rank: int, prefix: str = "load") -> dict[str, Any]:
    record: dict[str, Any] = json.loads((out / f"{prefix}_{rank}.json").read_text())
    return record


def _final(out: Path, prefix: str = "final") -> list[dict[str, torch.Tensor]]:
    return [torch.load(out / f"{prefix}_{r}.pt", weights_only=True) for r in range(2)]


def _same_value(ours: Any, theirs: Any, path: str) -> None:
    """Equal as DeepSpeed would read them: tensors bit for bit, objects by their attributes."""
    if isinstance(theirs, torch.Tensor):
        assert_same(ours, theirs, path)
    elif isinstance(theirs, dict):
        assert set(ours) == set(theirs), (path, set(ours) ^ set(theirs))
        for key in theirs:
            _same_value(ours[key], theirs[key], f"{path}.{key}")
    elif isinstance(theirs, (list, tuple)):
        assert type(ours) is type(theirs) and len(ours) == len(theirs), path
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            _same_value(a, b, f"{path}.{i}")
    elif hasattr(theirs, "__dict__") and not isinstance(theirs, type):
        assert type(ours) is type(theirs), path
        _same_value(vars(ours), vars(theirs), path)
    else:
        assert ours == theirs, (path, ours, theirs)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_saves_deepspeeds_files_and_resumes_from_memory(
    tmp_path: Path, stage: int
) -> None:
    """One failure-free run writes our files and DeepSpeed's own of the same state (compared
    file by file, read by DeepSpeed's loaders); a run whose rank 1 is SIGKILLed resumes from
    memory and ends with the failure-free run's model."""
    ref_ckpt, own = tmp_path / "ref-ckpt", tmp_path / "own"
    with running_saver(tmp_path) as saver:
        _run("train", stage, ref_ckpt, tmp_path / "ref", saver.socket_path, f"--own-save={own}")
    reference = _final(tmp_path / "ref")
    _check_files_as_deepspeeds(stage, ref_ckpt, own, tmp_path / "ref")

    ckpt = tmp_path / "ckpt"
    with running_saver(tmp_path) as saver:
        _run("train", stage, ckpt, tmp_path / "a", saver.socket_path, "--kill-at=5",
             expect_kill=True)  # fmt: skip
        _run("train", stage, ckpt, tmp_path / "b", saver.socket_path, restart=1)
    for rank in range(2):
        loaded = _load_record(tmp_path / "b", rank)
        assert loaded["source"] == "memory", loaded
        # Step 4 was saved to memory only; step 5's save never happened (rank 1 was killed).
        assert loaded["global_steps"] == 4 and loaded["client"]["step"] == 4, loaded
        assert loaded["path"] == str(ckpt / "global_step4")
    for got, want in zip(_final(tmp_path / "b"), reference, strict=True):
        assert_same(got, want)
    # Storage holds the last DISK step in DeepSpeed's layout, its marker written last.
    assert (ckpt / "latest").read_text() == f"global_step{STEPS}"


def _check_files_as_deepspeeds(stage: int, ckpt: Path, own: Path, out: Path) -> None:
    tag = f"global_step{STEPS}"
    assert (ckpt / "latest").read_text() == (own / "latest").read_text() == tag
    theirs = sorted(p.name for p in (own / tag).iterdir())
    ours = sorted(p.name for p in (ckpt / tag).iterdir())
    assert ours == sorted([*theirs, "manifest.json", "node_0.json"]), (ours, theirs)
    assert any("optim_states" in name for name in theirs)
    for name in theirs:
        want = torch.load(own / tag / name, weights_only=False)
        got = torch.load(ckpt / tag / name, weights_only=False)
        _same_value(got, want, name)
    # DeepSpeed's own offline reader (zero_to_fp32) and its engine read our directory.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    assert_same(
        dict(get_fp32_state_dict_from_zero_checkpoint(str(ckpt))),
        dict(get_fp32_state_dict_from_zero_checkpoint(str(own))),
    )
    _run("load-own", stage, ckpt, out, None)
    for rank in range(2):
        loaded = _load_record(out, rank, "load_own")
        assert loaded["global_steps"] == STEPS and loaded["client"]["step"] == STEPS, loaded
    for got, want in zip(_final(out, "load_own"), _final(out), strict=True):
        assert_same(got, want)
