"""MegatronCheckpointer with megatron.core's GPT model (CPU, gloo, 2 ranks, TP or PP 2)."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from tests.checkpoint.harness import (
    assert_same,
    free_port,
    run_ranks,
    running_saver,
    skip_without_megatron_core,
    without_tensorflow,
    worker_env,
)

# Each rank's start (import, process group, model) takes 10-20 s here, more on a busy machine.
# One test process runs them all (.ci/run: -n 2 --dist loadgroup): the job fixture runs once.
ONE_PROCESS = pytest.mark.xdist_group("megatron")
pytestmark = [pytest.mark.extras, pytest.mark.timeout(900), ONE_PROCESS]
skip_without_megatron_core()

STEPS, DISK_EVERY, KILL_AT = 6, 3, 5
LAYOUTS = {
    "tp2": ["mp_rank_00/model_optim_rng.pt", "mp_rank_01/model_optim_rng.pt"],
    "pp2": ["mp_rank_00_000/model_optim_rng.pt", "mp_rank_00_001/model_optim_rng.pt"],
}
"""Each parallel layout the job runs, and the file of each rank in Megatron-LM's layout."""


@pytest.fixture(scope="session")  # computed once per test process, whatever runs between
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-rank job for both layouts, launched twice as the agent would restart it: the first
    launch runs each layout failure-free, then again until step 5, where rank 1 of the last
    layout is SIGKILLed (its peer is killed with it); the second launch resumes each layout
    from its agent's memory and finishes. Each layout has its own saver in this process."""
    out = tmp_path_factory.mktemp("megatron")
    with ExitStack() as stack:
        savers = [stack.enter_context(running_saver(out)) for _ in LAYOUTS]
        args = [f"--out={out}", f"--layouts={','.join(LAYOUTS)}",
                f"--sockets={','.join(s.socket_path for s in savers)}", f"--steps={STEPS}",
                f"--disk-every={DISK_EVERY}", f"--kill-at={KILL_AT}"]  # fmt: skip
        _launch(["first", *args, "--kill"], out / "logs-first", kill_at_rank=1)
        _launch(["second", *args], out / "logs-second", restart=1)
    return out


def _launch(
    args: list[str], logs: Path, *, restart: int = 0, kill_at_rank: int | None = None
) -> None:
    port = free_port()
    envs = [without_tensorflow(worker_env(None, rank, 2, port, restart)) for rank in range(2)]
    run_ranks("tests.checkpoint.megatron_workers", args, envs, logs, kill_at_rank=kill_at_rank)


def _states(root: Path, prefix: str) -> list[dict[str, torch.Tensor]]:
    return [torch.load(root / f"{prefix}_{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_files_are_where_megatron_puts_them_and_hold_the_model(job: Path, layout: str) -> None:
    """Megatron-LM's layout, read back with torch.load as its loader does: one file per stage."""
    ckpt = job / layout / "ref-ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(STEPS)
    for name, reference in zip(LAYOUTS[layout], _states(job / layout, "reference"), strict=True):
        content = torch.load(ckpt / f"iter_{STEPS:07d}" / name, weights_only=False)
        assert content["iteration"] == STEPS and content["checkpoint_version"] == 3.0
        assert {"model", "optimizer", "opt_param_scheduler", "rng_state"} <= set(content)
        model = {k: v for k, v in content["model"].items() if v is not None}
        assert_same(model, reference)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_killed_rank_resumes_from_memory_to_the_failure_free_model(job: Path, layout: str) -> None:
    root = job / layout
    for rank in range(2):
        loaded = json.loads((root / f"load_{rank}.json").read_text())
        assert loaded == {"source": "memory", "iteration": KILL_AT - 1}, loaded
    for got, want in zip(_states(root, "resumed"), _states(root, "reference"), strict=True):
        assert_same(got, want)
    assert (root / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == str(STEPS)
