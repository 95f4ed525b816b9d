"""Megatron-LM's torch_dist format through the drop-ins: a Megatron-LM style loop with
``--ckpt-format torch_dist`` and training.py's exact calls, megatron.core's GPT model (CPU, gloo,
tensor parallel 2), under dlrover-run. A killed rank resumes from memory; megatron.core's own
loader reads the persisted steps and reshards them; a job shrunk from 2 to 1 data-parallel
ranks (4 to 2 processes) resumes from storage with the state a failure-free run has."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.checkpoint.harness import skip_without_megatron_core, without_tensorflow
from tests.conftest import SCRIPTS, clean_env, dlrover_run

# Each rank's start (import, process group, model) takes several seconds here: the jobs run
# once per test process (.ci/run: -n 2 --dist loadgroup keeps the group in one).
pytestmark = [pytest.mark.extras, pytest.mark.timeout(900), pytest.mark.xdist_group("megatron")]
skip_without_megatron_core()

LOOP = str(SCRIPTS / "megatron_torch_dist_loop.py")
STEPS, KILL_AT, LONGER = 6, 5, 9


def _train(out: Path, nproc: int, *more: str, restarts: int = 0) -> None:
    out.mkdir(parents=True, exist_ok=True)
    r = dlrover_run(
        [
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={restarts}",
            LOOP,
            str(out),
            *more,
        ],  # fmt: skip
        env=without_tensorflow(clean_env()),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-5000:]


@pytest.fixture(scope="session")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ref: 4 ranks (tensor parallel 2 x data parallel 2), failure-free to step 9. killed: the
    same to step 6, rank 1 SIGKILLed at step 5 on the first attempt. shrunk: 2 ranks (data
    parallel 1) resume killed's storage and train to step 9. read: megatron.core's own load of
    killed's step 6 at tensor parallel 1 (one rank)."""
    root = tmp_path_factory.mktemp("torch_dist")
    _train(root / "ref", 4, "train", "--tp=2", f"--steps={LONGER}")
    _train(root / "killed", 4, "train", "--tp=2", f"--steps={STEPS}", f"--kill-at={KILL_AT}",
           restarts=1)  # fmt: skip
    ckpt = f"--ckpt={root / 'killed' / 'ckpt'}"
    _train(root / "shrunk", 2, "train", "--tp=2", f"--steps={LONGER}", ckpt)
    _train(root / "read", 1, "read", "--tp=1", f"--iteration={STEPS}", ckpt)
    return root


def _state(path: Path) -> dict:
    return torch.load(path, weights_only=False)


def _assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_the_step_is_in_megatrons_torch_dist_layout(jobs: Path) -> None:
    ckpt = jobs / "killed" / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(LONGER)
    step = ckpt / f"iter_{STEPS:07d}"
    names = {p.name for p in step.iterdir()}
    assert {"metadata.json", "common.pt", ".metadata", "__0_0.distcp"} <= names
    assert json.loads((step / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    common = torch.load(step / "common.pt", weights_only=False)
    assert common["iteration"] == STEPS and common["checkpoint_version"] == 3.0
    assert common["args"].ckpt_format == "torch_dist"  # Megatron-LM's loader reads its args


def test_a_killed_rank_resumes_from_memory_to_the_failure_free_model(jobs: Path) -> None:
    for rank in range(4):
        load = json.loads((jobs / "killed" / f"load_{rank}.json").read_text())
        assert load["iteration"] == KILL_AT - 1 and load["source"] == "memory"
        assert load["consumed"] == 4 * (KILL_AT - 1)  # from Megatron-LM's args in the step
        assert load["lr"] > 0  # megatron.core's scheduler came back (0 at iteration 0)
        got = _state(jobs / "killed" / f"state{STEPS}_{rank}.pt")
        want = _state(jobs / "ref" / f"state{STEPS}_{rank}.pt")
        _assert_same(got["model"], want["model"])
        assert got["lr"] == want["lr"] and got["scheduler"] == want["scheduler"]


def test_a_job_shrunk_to_fewer_data_parallel_ranks_resumes_with_the_failure_free_state(
    jobs: Path,
) -> None:
    for rank in range(2):
        load = json.loads((jobs / "shrunk" / f"load_{rank}.json").read_text())
        assert load["iteration"] == STEPS and load["source"] == "storage"
        got = _state(jobs / "shrunk" / f"state{LONGER}_{rank}.pt")
        want = _state(jobs / "ref" / f"state{LONGER}_{rank}.pt")  # same tensor-parallel rank
        _assert_same(got["model"], want["model"])
        # Adam's moments came along, resharded: three more steps land on the same model.
        for pid, moments in want["optimizer"]["state"].items():
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(got["optimizer"]["state"][pid][name], moments[name])


def test_megatrons_own_loader_reads_the_step_at_another_tensor_parallel_size(jobs: Path) -> None:
    read = _state(jobs / "read" / "read_0.pt")
    parts = [_state(jobs / "ref" / f"state{STEPS}_{rank}.pt")["model"] for rank in range(2)]
    key = "embedding.word_embeddings.weight"  # split by vocabulary rows over tensor ranks
    assert torch.equal(read[key], torch.cat([p[key] for p in parts]))
    norm = "decoder.final_layernorm.weight"  # replicated over tensor ranks
    assert torch.equal(read[norm], parts[0][norm])
