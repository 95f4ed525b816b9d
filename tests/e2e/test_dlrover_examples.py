"""DLRover users' scripts run unchanged under dlrover-run, through a SIGKILL after a flash
checkpoint: scripts written the way DLRover's own examples are (MNIST CNN, nanoGPT with DDP,
FSDP1 and FSDP2, a Hugging Face Trainer), each on 2 ranks over several epochs. The killed run
resumes from the memory step and ends with the failure-free run's model."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from tests.conftest import REPO, SCRIPTS, clean_env

STYLE = SCRIPTS / "dlrover_style"
RUN_TIMEOUT_S = 240.0


def events(out: Path, rank: int) -> list[dict[str, Any]]:
    path = out / f"events.{rank}.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    # A worker may be appending right now: a last line without its newline is not whole yet.
    lines = text.split("\n")[:-1]
    return [json.loads(line) for line in lines if line.strip()]


LAUNCHED: list[subprocess.Popen[bytes]] = []
"""The jobs the running test launched: any still running at its end is killed, process tree
and all (`_no_job_outlives_its_test`)."""


@pytest.fixture(autouse=True)
def _no_job_outlives_its_test() -> Iterator[None]:
    """A test that fails while a job runs (a campaign's pair, an assertion before `finish`)
    must not leave the job behind: CI once found both ranks of such a job still spinning, a
    core's worth, through the rest of the stage."""
    yield
    while LAUNCHED:
        proc = LAUNCHED.pop()
        if proc.poll() is None:
            kill_tree(proc, _tree(proc))


def _tree(proc: subprocess.Popen[bytes]) -> list[int]:
    """The job's pid and every process under it (agent, zygote, workers)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        return [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    return [proc.pid]


def kill_tree(proc: subprocess.Popen[bytes], tree: list[int]) -> None:
    """SIGKILL every process of ``tree`` and reap the job."""
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(10)


def launch(
    script: str, args: list[str], log: Path, launcher: str = "dlrover-run"
) -> subprocess.Popen[bytes]:
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    else:
        command = [sys.executable, "-m", "dlrover.cli.run", "--standalone"]
    command += ["--nproc_per_node=2", "--max-restarts=2", str(STYLE / script), *args]
    # PYTHONFAULTHANDLER: a process that gets SIGABRT prints every thread's stack to the log.
    proc = subprocess.Popen(
        command, env=clean_env(PYTHONFAULTHANDLER="1"), cwd=REPO, stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    LAUNCHED.append(proc)
    return proc


def finish(proc: subprocess.Popen[bytes], log: Path) -> None:
    try:
        code = proc.wait(RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # Where each process waits, in the log: SIGABRT makes them print their stacks.
        tree = _tree(proc)
        for pid in reversed(tree):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        kill_tree(proc, tree)
        raise AssertionError(
            f"the job did not end in {RUN_TIMEOUT_S}s:\n{log.read_text()[-6000:]}"
        ) from None
    assert code == 0, log.read_text()[-6000:]


def end_after_the_work(
    proc: subprocess.Popen[bytes], log: Path, done: Path, grace_s: float = 60.0
) -> None:
    """Wait for a torchrun job until its script wrote ``done`` as its last work, then up to
    ``grace_s`` for it to exit; one whose worker hangs or aborts in interpreter shutdown (torch
    2.13's gloo threads, now and then) is ended, whatever torchrun would report: torchrun has no
    exit-hang watch (dlrover-run's ends such a rank), and the work this test moves is done."""
    if not wait_for_file(proc, done, RUN_TIMEOUT_S):
        finish(proc, log)  # the work itself did not end: that fails the test
        return
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    if proc.poll() is None:
        kill_tree(proc, _tree(proc))


def wait_for_file(proc: subprocess.Popen[bytes], path: Path, timeout: float) -> bool:
    """Whether ``path`` exists before ``proc`` ends or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return True
        if proc.poll() is not None:
            return path.exists()
        time.sleep(0.1)  # a file written by another process: no event to wait on
    return False


def kill_after_save(
    proc: subprocess.Popen[bytes], out: Path, rank: int, min_step: int, log: Path
) -> int:
    """SIGKILL ``rank``'s first-attempt process once both ranks recorded a save of a step >=
    ``min_step``; the newest step both saved. (A sharded state is in memory only once every
    rank saved it: killed after its own first save, rank 1 may find rank 0's part missing on a
    busy machine, and the restart rightly begins from nothing.)"""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        saves = {
            r: [e for e in events(out, r) if e["event"] == "saved" and e["restart"] == 0]
            for r in (0, 1)
        }
        newest = {r: max((int(e["step"]) for e in saves[r]), default=-1) for r in saves}
        if min(newest.values()) >= min_step:
            os.kill(saves[rank][-1]["pid"], signal.SIGKILL)
            return min(newest.values())
        assert proc.poll() is None, f"the job ended before the kill:\n{log.read_text()[-4000:]}"
        time.sleep(0.02)  # files being appended to: no event to wait on
    raise AssertionError(f"no save of step >= {min_step} by both ranks in {RUN_TIMEOUT_S}s: {log}")


def kill_after_saves(jobs: list[tuple[subprocess.Popen[bytes], Path, int, int, Path]]) -> list[int]:
    """SIGKILL each job's ``rank`` once it records a save of a step >= its ``min_step``, each
    job once, whichever attempt is running (a first attempt that failed by itself, a worker
    stalled until gloo's timeout, must not void the run: what these runs hold is that every
    one ends with the failure-free model)."""
    killed: dict[int, int] = {}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while len(killed) < len(jobs) and time.monotonic() < deadline:
        for i, (proc, out, rank, min_step, log) in enumerate(jobs):
            if i in killed:
                continue
            for event in events(out, rank):
                if event["event"] == "saved" and event["step"] >= min_step:
                    os.kill(event["pid"], signal.SIGKILL)
                    killed[i] = int(event["step"])
                    break
            else:
                assert proc.poll() is None, (
                    f"the job ended before the kill:\n{log.read_text()[-4000:]}"
                )
        time.sleep(0.02)  # files being appended to: no event to wait on
    missing = [jobs[i][4] for i in range(len(jobs)) if i not in killed]
    assert not missing, f"no save to kill after in {RUN_TIMEOUT_S}s: {missing}"
    return [killed[i] for i in range(len(jobs))]


def final_model(out: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = torch.load(out / "final.pt", weights_only=True)
    return state


def assert_same_model(out: Path, reference: Path) -> None:
    ours, theirs = final_model(out), final_model(reference)
    assert ours.keys() == theirs.keys()
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0, msg=key)


SCENARIOS: dict[str, tuple[str, list[str], int]] = {
    # name: (script, arguments, the first step a kill may follow)
    "mnist": ("mnist_cnn.py", ["--num_epochs", "3", "--save_memory_interval", "5"], 12),
    "nanogpt": ("nanogpt.py", ["--epochs", "2"], 40),
    "nanogpt-fsdp1": ("nanogpt.py", ["--epochs", "2", "--fsdp", "1"], 40),
    "nanogpt-fsdp2": ("nanogpt.py", ["--epochs", "2", "--fsdp", "2"], 20),
    # Saves at epoch ends: transformers + accelerate resume the middle of an epoch with the
    # order of epoch 0 in multi-process training (skip_first_batches builds a loader whose
    # iteration count restarts at 0), with their own checkpoints too; see docs/from_dlrover.md.
    "hf-trainer": ("hf_trainer.py", ["--epochs", "3", "--save_steps", "8"], 8),
}


def _paths(tmp: Path, name: str, script: str) -> tuple[Path, list[str]]:
    out = tmp / f"{name}-out"
    out.mkdir()
    ckpt = tmp / f"{name}-ckpt"
    if script == "mnist_cnn.py":
        return out, ["--ckpt_dir", str(ckpt), "--out", str(out)]
    if script == "nanogpt.py":
        return out, ["--save_dir", str(ckpt), "--out", str(out)]
    return out, ["--output_dir", str(ckpt), "--out", str(out)]


@pytest.mark.parametrize(
    "scenario",
    [
        pytest.param(name, marks=pytest.mark.extras if name == "hf-trainer" else pytest.mark.e2e)
        for name in SCENARIOS
    ],
)
def test_dlrover_style_script_resumes_from_memory_after_a_kill(
    tmp_path: Path, scenario: str
) -> None:
    script, args, min_step = SCENARIOS[scenario]
    if script == "hf_trainer.py":
        pytest.importorskip("transformers", reason="transformers is not installed")
        pytest.importorskip("accelerate", reason="accelerate is not installed")

    reference, ref_args = _paths(tmp_path, "reference", script)
    log = tmp_path / "reference.log"
    finish(launch(script, [*ref_args, *args], log), log)

    out, run_args = _paths(tmp_path, "killed", script)
    log = tmp_path / "killed.log"
    proc = launch(script, [*run_args, *args], log)
    killed_at = kill_after_save(proc, out, 1, min_step, log)
    finish(proc, log)

    assert_same_model(out, reference)
    restarted = [e for e in events(out, 1) if e["restart"] >= 1]
    begin = next(e for e in restarted if e["event"] in ("train_begin", "start") and e["step"])
    # The memory step saved before the kill (or a later one the kill did not prevent).
    assert begin["step"] >= killed_at, (begin, killed_at)
    assert begin["source"] == "memory", begin
    every = [e for rank in (0, 1) for e in events(out, rank)]
    assert all(e["returned"] for e in every if e["event"] == "saved")
    for rank in (0, 1):
        trained = {e["epoch"] for e in events(out, rank) if e["event"] == "epoch"}
        expected = {e["epoch"] for e in events(reference, rank) if e["event"] == "epoch"}
        assert trained == expected and len(expected) >= 2, (rank, trained, expected)


@pytest.mark.e2e
@pytest.mark.parametrize("first,second", [("torchrun", "dlrover-run"), ("dlrover-run", "torchrun")])
def test_a_checkpoint_moves_between_torchrun_and_dlrover_run(
    tmp_path: Path, first: str, second: str
) -> None:
    """The first launcher trains part of the run and stops; the second resumes from storage
    (sampler state included) and ends with the model of one uninterrupted run."""
    args = ["--epochs", "2", "--save_storage_interval", "20"]
    reference, ref_args = _paths(tmp_path, "reference", "nanogpt.py")
    log = tmp_path / "reference.log"
    finish(launch("nanogpt.py", [*ref_args, *args], log), log)

    out, run_args = _paths(tmp_path, "moved", "nanogpt.py")
    log = tmp_path / "first.log"
    # First launcher: train to 40 of 60 steps (epoch 1), then stop: a job that ends early.
    proc = launch("nanogpt.py", [*run_args, *args, "--max_iters", "40"], log, first)
    if first == "torchrun":
        end_after_the_work(proc, log, out / "final.sha256")
    else:
        finish(proc, log)
    (out / "final.pt").unlink(missing_ok=True)
    log = tmp_path / "second.log"
    finish(launch("nanogpt.py", [*run_args, *args], log, second), log)
    assert_same_model(out, reference)
    begins = [e for e in events(out, 0) if e["event"] == "start"]
    assert [b["step"] for b in begins] == [0, 40], begins
    assert begins[1]["source"] == "storage"


# A memory save every step: no gradient accumulation, whose partial sums no checkpoint holds.
NO_JOIN_ARGS = ["--epochs", "2", "--gradient_accumulation_steps", "2"]
NO_JOIN_ARGS += ["--save_memory_interval", "1", "--save_storage_interval", "1000"]


@pytest.fixture(scope="session")  # computed once per test process, whatever runs between
def no_join_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The failure-free model of the no-Join loop (once per test process)."""
    reference, ref_args = _paths(tmp_path_factory.mktemp("no-join"), "reference", "nanogpt.py")
    log = reference.with_suffix(".log")
    finish(launch("nanogpt.py", [*ref_args, *NO_JOIN_ARGS], log), log)
    return reference


@pytest.mark.campaign  # 20 seeded kills
@pytest.mark.parametrize("first", range(0, 20, 4))  # 5 chunks of 4 seeds: CI spreads them out
def test_ddp_loop_without_join_never_hangs_after_kills(
    tmp_path: Path, no_join_reference: Path, first: int
) -> None:
    """A synchronous DDP loop (no Join) over ElasticDistributedSampler, one worker SIGKILLed at
    a random step in each of 20 seeded runs (two jobs at a time: they share no port): every run
    ends, with the failure-free model."""
    for pair in (first, first + 2):
        runs = []
        for seed in (pair, pair + 1):
            out, run_args = _paths(tmp_path, f"seed{seed}", "nanogpt.py")
            log = tmp_path / f"seed{seed}.log"
            runs.append((seed, out, log, launch("nanogpt.py", [*run_args, *NO_JOIN_ARGS], log)))
        kill_after_saves(
            [
                (proc, out, seed % 2, random.Random(seed).randrange(1, 60), log)
                for seed, out, log, proc in runs
            ]
        )
        for _, out, log, proc in runs:
            finish(proc, log)
            assert_same_model(out, no_join_reference)
