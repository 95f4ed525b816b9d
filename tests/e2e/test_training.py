"""Real training jobs: standalone, several nodes through a separate master, restarts."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from dlrover.checkpoint.leftovers import sweep
from tests.conftest import REPO, SCRIPTS, MasterProcess, clean_env, dlrover_run, run_cmd

EXAMPLE = str(REPO / "examples" / "train_mlp.py")


def _results(out: Path, n: int) -> list[tuple[float, float, float, int, int]]:
    rows = []
    for r in range(n):
        first, last, checksum, world, group_rank = (
            (out.parent / f"{out.name}.rank{r}").read_text().split()
        )
        rows.append((float(first), float(last), float(checksum), int(world), int(group_rank)))
    return rows


@pytest.mark.e2e
def test_standalone_trains_and_the_loss_falls(tmp_path: Path):
    out = tmp_path / "result"
    r = dlrover_run(
        ["--standalone", "--nproc_per_node=2", EXAMPLE, "--steps", "60", "--out", str(out)]
    )
    assert r.returncode == 0, r.stderr
    assert "step 60/60 loss" in r.stdout and "samples/s" in r.stdout
    rows = _results(out, 2)
    assert all(last < first / 5 for first, last, *_ in rows)
    assert rows[0][2] == rows[1][2]  # DDP keeps replicas equal


@pytest.mark.e2e
def test_two_nodes_through_a_separate_master_form_one_world(tmp_path: Path):
    master = MasterProcess(tmp_path)
    try:
        env = clean_env(**master.vars)
        out = tmp_path / "result"
        nodes = [
            subprocess.Popen(
                [
                    *run_cmd("dlrover.cli.run"),
                    "--nnodes=2",
                    "--nproc-per-node=2",
                    EXAMPLE,
                    "--steps",
                    "30",
                    "--out",
                    str(out),
                ],
                env=env,
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for _ in range(2)
        ]
        logs = [p.communicate(timeout=180)[0] for p in nodes]
        if [p.returncode for p in nodes] != [0, 0]:
            print("\n\n".join(logs))  # shown in full by pytest on failure
        assert [p.returncode for p in nodes] == [0, 0]
        assert master.wait(60) == 0
    finally:
        master.close()
    rows = _results(out, 4)
    assert {row[3] for row in rows} == {4}
    assert sorted(row[4] for row in rows) == [0, 0, 1, 1]
    assert len({row[2] for row in rows}) == 1  # all ranks agree on the final parameters


def test_failed_worker_restarts_in_place_with_a_fresh_store_port(tmp_path: Path):
    logs = tmp_path / "logs"
    r = dlrover_run(
        [
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            "--log-dir",
            str(logs),
            "--rdzv-id",
            "job",
            "-r",
            "3",
            str(SCRIPTS / "flaky.py"),
            str(tmp_path),
        ]
    )
    assert r.returncode == 0, r.stderr
    # attempt.<rank>.<restart>: rank 1 failed in restart 0 (rank 0 may have been stopped before
    # it wrote its file), both ranks ran restart 1.
    attempts = {p.name for p in tmp_path.glob("attempt.*")}
    assert {"attempt.1.0", "attempt.0.1", "attempt.1.1"} <= attempts
    assert attempts <= {"attempt.0.0", "attempt.1.0", "attempt.0.1", "attempt.1.1"}
    port0 = (tmp_path / "attempt.1.0").read_text()
    port1 = (tmp_path / "attempt.1.1").read_text()
    assert port0 != port1
    # Per-attempt, per-rank log directories.
    assert (logs / "job" / "attempt_0" / "rank_1" / "stdout.log").exists()
    assert (logs / "job" / "attempt_1" / "rank_0" / "stderr.log").exists()


def test_restart_budget_exhausted_fails_with_the_root_cause(tmp_path: Path):
    r = dlrover_run(
        [
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=0",
            str(SCRIPTS / "flaky.py"),
            str(tmp_path),
        ]
    )
    assert r.returncode == 3
    assert "exit code 3" in r.stderr and "job failed" in r.stderr


def test_sigterm_stops_every_worker_and_grandchild(tmp_path: Path):
    proc = subprocess.Popen(
        [
            *run_cmd("dlrover.cli.run"),
            "--standalone",
            "--nproc-per-node=2",
            "--shutdown-timeout=2",
            str(SCRIPTS / "sleeper.py"),
            str(tmp_path),
        ],
        env=clean_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        pid_files = [tmp_path / "pids.0", tmp_path / "pids.1"]
        _wait_for(lambda: all(p.exists() and p.read_text() for p in pid_files), proc)
        pids = [int(x) for p in pid_files for x in p.read_text().split()]
        assert all(_alive(p) for p in pids)
        proc.terminate()
        proc.wait(timeout=15)
        assert proc.returncode == 128 + 15
        assert not [p for p in pids if _alive(p)]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigkill_of_the_agent_leaves_no_orphan_workers(tmp_path: Path):
    proc = subprocess.Popen(
        [
            *run_cmd("dlrover.cli.run"),
            "--standalone",
            "--nproc-per-node=2",
            str(SCRIPTS / "sleeper.py"),
            str(tmp_path),
        ],
        env=clean_env(),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pid_files = [tmp_path / "pids.0", tmp_path / "pids.1"]
    _wait_for(lambda: all(p.exists() and p.read_text() for p in pid_files), proc)
    workers = [int(p.read_text().split()[0]) for p in pid_files]
    proc.kill()
    proc.wait(timeout=10)
    try:
        _wait_for(lambda: not any(_alive(p) for p in workers), None, timeout=10)
    finally:
        for pgid in workers:  # the workers' own children are the test's to clean up
            try:
                os.killpg(pgid, 9)
            except ProcessLookupError:
                pass
        # A SIGKILLed agent cannot tidy up: its lock in /dev/shm and its temp folder stay until
        # the next agent's sweep on the node, which this is (only what dead owners left).
        removed = sweep()
    assert any(f".{proc.pid}." in path for path in removed), removed


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(cond, proc, timeout: float = 60) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"dlrover-run exited early with {proc.returncode}")
        if time.monotonic() > deadline:
            raise AssertionError("condition not met within the deadline")
        time.sleep(0.02)


assert os.name == "posix"


@pytest.mark.e2e
def test_hung_workers_are_detected_and_restarted(tmp_path: Path):
    r = dlrover_run(
        [
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            "--hang-timeout=1.5",
            str(SCRIPTS / "hang_once.py"),
            str(tmp_path),
        ],
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert re.search(r"hang: rank [01]: \d+s in step \(--hang-timeout 1.5s\)", r.stderr)
    assert sorted(p.read_text() for p in tmp_path.glob("done.*")) == ["1", "1"]


@pytest.mark.e2e
def test_a_rank_slow_to_exit_after_its_script_returned_is_not_a_hang(tmp_path: Path):
    """--hang-timeout watches steps while the script runs: after it returned (its done file),
    a slow interpreter exit is the exit-hang watch's to judge. It was taken for a hang and the
    rank restarted, after the other nodes had succeeded (found by benchmarks/fault_campaign.py:
    a rank held to 1/9 of a CPU by two slow faults, and the job waited forever)."""
    r = dlrover_run(
        [
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            "--hang-timeout=1.5",
            str(SCRIPTS / "slow_exit.py"),
            str(tmp_path),
        ],
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "hang:" not in r.stderr, r.stderr
    assert sorted(p.read_text() for p in tmp_path.glob("done.*")) == ["0", "0"]


def test_same_user_error_twice_fails_fast_with_the_root_cause(tmp_path: Path):
    script = tmp_path / "bad.py"
    script.write_text(
        "import os\n"
        "def step():\n"
        "    raise ValueError('bad learning rate')\n"
        "if os.environ['RANK'] == '1':\n"
        "    step()\n"
    )
    r = dlrover_run(["--standalone", "--nproc-per-node=2", "--max-restarts=5", str(script)])
    assert r.returncode == 1
    assert "ValueError: bad learning rate" in r.stderr
    assert "root cause: rank 1" in r.stderr
    # Failed on the second identical error, not after all five restarts.
    assert r.stderr.count("restart 1/5") == 1 and "restart 2/5" not in r.stderr


def test_an_abort_after_the_user_error_still_fails_fast(tmp_path: Path):
    """As torch/gloo sometimes do in their teardown after an uncaught exception ('terminate
    called without an active exception'), the rank dies by SIGABRT after its error file is
    written: the second identical error still fails the job fast, with the root cause. (The
    script's done file counts the abort as its exit code 1; without one, the policy reads the
    error file: tests/faults/test_failure_policy.py.)"""
    script = tmp_path / "bad_abort.py"
    script.write_text(
        "import atexit, os\n"
        "def step():\n"
        "    raise ValueError('bad learning rate')\n"
        "if os.environ['RANK'] == '1':\n"
        "    atexit.register(os.abort)\n"
        "    step()\n"
    )
    r = dlrover_run(["--standalone", "--nproc-per-node=2", "--max-restarts=5", str(script)])
    assert r.returncode != 0
    assert "ValueError: bad learning rate" in r.stderr
    assert "same user error twice" in r.stderr
    assert r.stderr.count("restart 1/5") == 1 and "restart 2/5" not in r.stderr
