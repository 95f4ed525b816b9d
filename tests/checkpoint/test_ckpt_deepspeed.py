"""DeepSpeedCheckpointer with real DeepSpeed (CPU accelerator, gloo, 2 ranks, ZeRO 1-3)."""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
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
# One test process runs them all (.ci/run: -n 2 --dist loadgroup): the job fixture runs once.
ONE_PROCESS = pytest.mark.xdist_group("deepspeed")
pytestmark = [pytest.mark.extras, pytest.mark.timeout(900), ONE_PROCESS]
deepspeed = pytest.importorskip(
    "deepspeed", reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed==0.19.8)"
)

STEPS, DISK_EVERY, KILL_AT = 6, 3, 5
STAGES = (1, 2, 3)


@pytest.fixture(scope="session")  # computed once per test process, whatever runs between
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-rank job for every ZeRO stage, launched twice as the agent would restart it: the
    first launch runs each stage failure-free (our files and DeepSpeed's own of the same
    state), then again until step 5, where rank 1 of the last stage is SIGKILLed (its peer is
    killed with it); the second launch resumes each stage from its agent's memory, finishes,
    and has DeepSpeed alone load the failure-free run's files. Each stage has its own saver
    (its own agent's memory) in this process."""
    out = tmp_path_factory.mktemp("deepspeed")
    with ExitStack() as stack:
        savers = [stack.enter_context(running_saver(out)) for _ in STAGES]
        args = [f"--out={out}", f"--stages={','.join(map(str, STAGES))}",
                f"--sockets={','.join(s.socket_path for s in savers)}", f"--steps={STEPS}",
                f"--disk-every={DISK_EVERY}", f"--kill-at={KILL_AT}"]  # fmt: skip
        _launch(["first", *args, "--kill"], out / "logs-first", kill_at_rank=1)
        _launch(["second", *args], out / "logs-second", restart=1)
        # Then one rank alone (a job that lost a node) loads the failure-free run's files.
        fresh = [stack.enter_context(running_saver(out)) for _ in STAGES]  # nothing in memory
        sockets = f"--sockets={','.join(s.socket_path for s in fresh)}"
        _launch(["reshard", *args[:2], sockets, *args[3:]], out / "logs-reshard", world=1)
    return out


def _launch(
    args: list[str],
    logs: Path,
    *,
    restart: int = 0,
    kill_at_rank: int | None = None,
    world: int = 2,
) -> None:
    port = free_port()
    envs = [worker_env(None, rank, world, port, restart) for rank in range(world)]
    for env in envs:
        env["DS_ACCELERATOR"] = "cpu"
    run_ranks("tests.checkpoint.ds_workers", args, envs, logs, kill_at_rank=kill_at_rank)


def _record(root: Path, name: str) -> dict[str, Any]:
    record: dict[str, Any] = json.loads((root / name).read_text())
    return record


def _states(root: Path, prefix: str) -> list[dict[str, torch.Tensor]]:
    return [torch.load(root / f"{prefix}_{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("stage", STAGES)
def test_killed_rank_resumes_from_memory_to_the_failure_free_model(job: Path, stage: int) -> None:
    root = job / f"zero{stage}"
    for rank in range(2):
        loaded = _record(root, f"load_{rank}.json")
        assert loaded["source"] == "memory", loaded
        # Step 4 was saved to memory only; step 5's save never happened (rank 1 was killed).
        assert loaded["global_steps"] == KILL_AT - 1, loaded
        assert loaded["client"]["step"] == KILL_AT - 1, loaded
        assert loaded["path"] == str(root / "ckpt" / f"global_step{KILL_AT - 1}")
    for got, want in zip(_states(root, "resumed"), _states(root, "reference"), strict=True):
        assert_same(got, want)
    # Storage holds the last DISK step in DeepSpeed's layout, its marker written last.
    assert (root / "ckpt" / "latest").read_text() == f"global_step{STEPS}"


@pytest.mark.parametrize("stage", STAGES)
def test_files_are_deepspeeds_own_and_its_loaders_read_them(job: Path, stage: int) -> None:
    """Our files of the failure-free run against DeepSpeed's own save of the same state, file
    by file; DeepSpeed's zero_to_fp32 and its engine's load_checkpoint read ours."""
    root = job / f"zero{stage}"
    ckpt, own = root / "ref-ckpt", root / "own"
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
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    assert_same(
        dict(get_fp32_state_dict_from_zero_checkpoint(str(ckpt))),
        dict(get_fp32_state_dict_from_zero_checkpoint(str(own))),
    )
    for rank in range(2):
        loaded = _record(root, f"load_own_{rank}.json")
        assert loaded["global_steps"] == STEPS and loaded["client"]["step"] == STEPS, loaded
    for got, want in zip(_states(root, "load_own"), _states(root, "reference"), strict=True):
        assert_same(got, want)


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


@pytest.mark.parametrize("stage", STAGES)
def test_a_job_at_another_data_parallel_size_loads_the_step_resharded(
    job: Path, stage: int
) -> None:
    """One rank loads what two saved (ZeRO 1-3 partition the optimizer state by rank, and
    DeepSpeed's own loader refuses another count): the checkpointer converts the step once with
    DeepSpeed's ds_to_universal and loads it universally. The model is the saved one bit for
    bit, and the next step on both ranks' batches equals the two-rank job's next step: the
    Adam moments were re-partitioned, not started afresh."""
    root = job / f"zero{stage}"
    loaded = _record(root, "reshard.json")
    assert loaded["source"] == "storage", loaded
    assert loaded["global_steps"] == STEPS and loaded["client"]["step"] == STEPS, loaded
    assert loaded["path"] == str(root / "ref-ckpt" / f"global_step{STEPS}")
    assert (root / "ref-ckpt" / ".dlrover-universal" / f"global_step{STEPS}" / "zero").is_dir()
    resharded = torch.load(root / "resharded.pt", weights_only=True)
    assert_same(resharded, _states(root, "reference")[0])
    stepped = torch.load(root / "resharded_step.pt", weights_only=True)
    continued = _states(root, "continued")[0]
    assert set(stepped) == set(continued)
    for name, value in continued.items():
        torch.testing.assert_close(stepped[name], value, rtol=1e-5, atol=1e-6, msg=name)
        assert not torch.equal(value, resharded[name]), name  # the step moved every tensor


def test_a_conversion_older_than_its_step_is_made_again(tmp_path: Path) -> None:
    """A later save under the same tag replaces the step: its old universal conversion must
    not be loaded."""
    from dlrover.trainer.torch.flash_checkpoint.deepspeed import _converted

    step, target = tmp_path / "loss", tmp_path / ".dlrover-universal" / "loss"
    step.mkdir()
    (step / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    assert not _converted(str(step), str(target))  # never converted
    target.mkdir(parents=True)
    assert _converted(str(step), str(target))
    newer = target.stat().st_mtime + 5
    os.utime(step / "zero_pp_rank_0_mp_rank_00_optim_states.pt", (newer, newer))
    assert not _converted(str(step), str(target))  # the tag was saved again since
