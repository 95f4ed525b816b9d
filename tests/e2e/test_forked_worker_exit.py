"""Issue 33: ranks forked from the zygote after a kill exit like spawned ones. 30 seeded runs of
pytorch/examples' DDP tutorial (with and without destroy_process_group()), one rank SIGKILLed at a
random step, the restart forked: every job ends with the final snapshot, and no rank hangs at exit
(a hang would be ended by the agent's --exit-hang-timeout, whose log line carries the stuck rank's
stacks, and fails the test). DLROVER_EXIT_TEST_RUNS sets the number of runs (30)."""

from __future__ import annotations

import os
import random
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, SCRIPTS, clean_env, run_cmd

RUNS = int(os.environ.get("DLROVER_EXIT_TEST_RUNS", "30"))
EPOCHS = 4
STEPS_PER_EPOCH = 4  # 64 samples, 2 ranks, batches of 8
HANG_MARK = "(--exit-hang-timeout)"


def _run(tmp_path: Path, seed: int) -> tuple[str, str]:
    """One job; returns (what went wrong or "", its console output)."""
    rng = random.Random(seed)
    run_dir = tmp_path / f"seed{seed}"
    run_dir.mkdir()
    console = run_dir / "console.txt"
    snapshot = run_dir / "snapshot.pt"
    env = clean_env(
        KILL_RANK=str(rng.randint(0, 1)),
        KILL_STEP=str(rng.randint(1, EPOCHS * STEPS_PER_EPOCH - 2)),
        CONSOLE_FILE=str(console),
        OMP_NUM_THREADS="1",
        DLROVER_ZYGOTE_NICE="0",  # ready while the machine is busy (tests run in parallel)
    )
    args = ["--epochs", str(EPOCHS), "--snapshot", str(snapshot)]
    if seed % 2:
        args.append("--no-destroy")
    with open(console, "w") as out:
        try:
            code = subprocess.run(
                [
                    *run_cmd("dlrover.cli.run"),
                    "--standalone",
                    "--nproc_per_node=2",
                    "--max-restarts=3",
                    "--monitor-interval=0.1",
                    "--exit-hang-timeout=5",
                    str(SCRIPTS / "ddp_tutorial.py"),
                    *args,
                ],
                env=env,
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=300,
            ).returncode
        except subprocess.TimeoutExpired:
            code = None
    text = console.read_text(errors="replace")
    if code is None:
        return "the job did not end within 300 s", text
    if code != 0:
        return f"dlrover-run exited {code}", text
    if text.count("forked 2 workers from the zygote") < 2:  # the first start and the restart
        return "the restart was not forked from the zygote", text
    if torch.load(snapshot)["EPOCHS_RUN"] != EPOCHS:
        return "the final snapshot is missing", text
    return "", text


CHUNKS = 3
"""The runs are split into this many tests, so that parallel test workers share them."""


@pytest.mark.long
@pytest.mark.campaign
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_forked_ranks_exit_after_a_kill_at_random_steps(tmp_path: Path, chunk: int) -> None:
    failed: list[str] = []
    hung: list[str] = []
    seeds = range(chunk, RUNS, CHUNKS)
    # Two jobs at a time (each its own master and ports): half the wall time on a 2-core CI.
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda seed: _run(tmp_path, seed), seeds))
    for seed, (problem, text) in zip(seeds, results, strict=True):
        if problem:
            failed.append(f"seed {seed}: {problem}\n{text[-6000:]}")
        if HANG_MARK in text:
            start = text.index(HANG_MARK)
            hung.append(f"seed {seed}: {text[max(0, start - 200) : start + 6000]}")
    assert not failed, "\n\n".join(failed)
    runs = len(seeds)
    assert not hung, f"{len(hung)} of {runs} runs had a rank hung at exit:\n\n" + "\n\n".join(hung)
