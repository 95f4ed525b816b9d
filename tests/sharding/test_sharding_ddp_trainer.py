"""ElasticTrainer in a real gloo DDP job whose world size changes 3 -> 2 -> 3."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
GLOBAL_BATCH = 12


@pytest.mark.e2e
def test_global_batch_is_kept_across_world_sizes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    phases = [(3, 2), (2, 2), (3, 2)]  # (world size, micro batch): accumulation 2, 3, 2
    steps_per_phase = 2
    rows_per_phase = steps_per_phase * GLOBAL_BATCH
    inputs = torch.randn(len(phases) * rows_per_phase, 3)
    targets = inputs @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.3
    reference = torch.nn.Linear(3, 1)
    start = {"weight": reference.weight.tolist(), "bias": reference.bias.tolist()}
    (tmp_path / "params0.json").write_text(json.dumps(start))
    for phase in range(len(phases)):
        rows = slice(phase * rows_per_phase, (phase + 1) * rows_per_phase)
        data = {"x": inputs[rows].tolist(), "y": targets[rows].tolist()}
        (tmp_path / f"data{phase}.json").write_text(json.dumps(data))

    # What one process training on whole global batches gets.
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for first in range(0, len(inputs), GLOBAL_BATCH):
        batch = slice(first, first + GLOBAL_BATCH)
        torch.nn.functional.mse_loss(reference(inputs[batch]), targets[batch]).backward()
        optimizer.step()
        optimizer.zero_grad()

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    phase_arg = ",".join(f"{world}x{micro}" for world, micro in phases)
    command = [sys.executable, str(HERE / "ddp_trainer_worker.py"), "--dir", str(tmp_path)]
    command += ["--phases", phase_arg, "--global-batch", str(GLOBAL_BATCH)]
    processes = [subprocess.Popen([*command, "--rank", str(r)], env=env) for r in range(3)]
    try:
        assert [p.wait(90.0) for p in processes] == [0, 0, 0]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()

    for phase, (world, micro) in enumerate(phases):
        results = [
            json.loads((tmp_path / f"phase{phase}_rank{rank}.json").read_text())
            for rank in range(world)
        ]
        assert {r["accumulation"] for r in results} == {GLOBAL_BATCH // (world * micro)}
        assert {r["optimizer_steps"] for r in results} == {steps_per_phase}
        assert all(r["weight"] == results[0]["weight"] for r in results)  # replicas agree
    final = json.loads((tmp_path / f"params{len(phases)}.json").read_text())
    expected_weight, expected_bias = reference.weight.detach(), reference.bias.detach()
    torch.testing.assert_close(torch.tensor(final["weight"]), expected_weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(final["bias"]), expected_bias, rtol=1e-5, atol=1e-6)
