"""DeepSpeedCheckpointer with real DeepSpeed (CPU accelerator, gloo, 2 ranks, ZeRO 1-3)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoint.harness import REPO, assert_same, free_port, running_saver, worker_env

pytestmark = [pytest.mark.extras, pytest.mark.slow]
deepspeed = pytest.importorskip(
    "deepspeed", reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed==0.19.8)"
)

STEPS, DISK_EVERY = 6, 3


def _start(mode: str, stage: int, ckpt: Path, out: Path, env: dict[str, str], *extra: str) -> Any:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.checkpoint.ds_workers", mode, f"--stage={stage}",
         f"--ckpt={ckpt}", f"--out={out}", f"--steps={STEPS}", f"--disk-every={DISK_EVERY}",
         *extra],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip


def _envs(socket_path: str | None, restart: int = 0) -> list[dict[str, str]]:
    port = free_port()
    envs = [worker_env(socket_path, rank, 2, port, restart) for rank in range(2)]
    for env in envs:
        env["DS_ACCELERATOR"] = "cpu"
    return envs


def _run(mode: str, stage: int, ckpt: Path, out: Path, socket_path: str | None,
         *extra: str, restart: int = 0, expect_kill: bool = False) -> None:  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    procs = [_start(mode, stage, ckpt, out, env, *extra) for env in _envs(socket_path, restart)]
    outputs = []
    try:
        for i, proc in enumerate(procs):
            if expect_kill and i == 0:
                # Rank 0 waits in a collective for the killed rank 1: end it once rank 1 is gone.
                procs[1].wait(180)
                proc.kill()
            outputs.append(proc.communicate(timeout=180)[0].decode())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    if expect_kill:
        assert procs[1].returncode == -9, outputs[1][-3000:]
        return
    for proc, text in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, text[-5000:]


def _load_record(out: Path, rank: int, prefix: str = "load") -> dict[str, Any]:
    record: dict[str, Any] = json.loads((out / f"{prefix}_{rank}.json").read_text())
    return record


def _final(out: Path, prefix: str = "final") -> list[dict[str, torch.Tensor]]:
    return [torch.load(out / f"{prefix}_{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("stage", [1, 2])
def test_rank_killed_resumes_from_memory_and_matches_failure_free_run(
    tmp_path: Path, stage: int
) -> None:
    _run("train", stage, tmp_path / "ref-ckpt", tmp_path / "ref", None)
    reference = _final(tmp_path / "ref")
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
    assert (ckpt / "latest").read_text() == "global_step6"


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


@pytest.mark.parametrize("stage", [1, 3])
def test_files_match_deepspeeds_own_and_load_with_its_loader(tmp_path: Path, stage: int) -> None:
    ckpt, own = tmp_path / "ckpt", tmp_path / "own"
    with running_saver(tmp_path) as saver:
        _run("train", stage, ckpt, tmp_path / "run", saver.socket_path, f"--own-save={own}")
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
    _run("load-own", stage, ckpt, tmp_path / "run", None)
    for rank in range(2):
        loaded = _load_record(tmp_path / "run", rank, "load_own")
        assert loaded["global_steps"] == STEPS and loaded["client"]["step"] == STEPS, loaded
    for got, want in zip(_final(tmp_path / "run", "load_own"), _final(tmp_path / "run")):
        assert_same(got, want)
