"""Bad input to dlrover-run / dlrover-master: one clear line, non-zero exit, nothing hangs."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import SCRIPTS, MasterProcess, clean_env, dlrover_run, run_cmd


@pytest.mark.parametrize(
    "args,message",
    [
        (["--standalone", "missing_script.py"], "training script 'missing_script.py' not found"),
        (["--nnodes", "3:2", "x.py"], "MIN (3) is greater than MAX (2)"),
        (["--nnodes", "two", "x.py"], "expected N or MIN:MAX"),
        (["--nproc-per-node", "0", "x.py"], "must be at least 1"),
        (["--max-restarts", "-1", "x.py"], "--max-restarts -1"),
        (["-r", "7", "x.py"], "--redirects '7'"),
        (["--standalone", "--nnodes", "2", "x.py"], "--standalone runs one node"),
    ],
)
def test_bad_flags_get_one_clear_error(args, message):
    t0 = time.monotonic()
    r = dlrover_run(args, timeout=30)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize(
    "target,cause",
    [
        (["-m", "no_such_module_xyz"], "BootstrapError: no module named 'no_such_module_xyz'"),
        (["BAD"], "SyntaxError: '(' was never closed"),
        (["IMPORTS"], "ModuleNotFoundError: No module named 'no_such_package_xyz'"),
    ],
)
def test_a_program_that_cannot_start_fails_at_once_without_restarts(
    tmp_path: Path, target: list[str], cause: str
) -> None:
    """A missing module, a script that does not compile or whose imports fail: restarts would
    not cure it, so the job fails after the first attempt (budget left), exit 127, naming the
    command and the cause."""
    (tmp_path / "bad.py").write_text("print(\n")
    (tmp_path / "imports.py").write_text("import no_such_package_xyz\n")
    names = {"BAD": str(tmp_path / "bad.py"), "IMPORTS": str(tmp_path / "imports.py")}
    target = [names.get(t, t) for t in target]
    r = dlrover_run(["--standalone", "--max-restarts=3", *target], timeout=60)
    assert r.returncode == 127, r.stderr[-3000:]
    assert f"job failed: `{' '.join(target)}`: the program cannot start (" in r.stderr, r.stderr
    assert cause in r.stderr, r.stderr[-3000:]
    assert r.stderr.count("started 1 workers") == 1, r.stderr[-3000:]  # never restarted


def test_multinode_without_a_master_says_how_to_get_one(tmp_path: Path):
    r = dlrover_run(["--nnodes", "2", str(SCRIPTS / "dump_env.py"), str(tmp_path)], timeout=30)
    assert r.returncode == 2 and "DLROVER_MASTER_ADDR" in r.stderr


def test_unreachable_master_fails_within_a_bounded_time(tmp_path: Path):
    env = clean_env(DLROVER_MASTER_ADDR="127.0.0.1:9", DLROVER_JOB_TOKEN="t")
    t0 = time.monotonic()
    r = dlrover_run(
        ["--nnodes", "2", str(SCRIPTS / "dump_env.py"), str(tmp_path)], env=env, timeout=60
    )
    assert r.returncode == 1
    assert "cannot reach the DLRover master at 127.0.0.1:9" in r.stderr
    assert time.monotonic() - t0 < 30
    assert not list(tmp_path.glob("env.*"))


def test_wrong_token_is_refused(tmp_path: Path, master: MasterProcess):
    env = clean_env(
        DLROVER_MASTER_ADDR=master.vars["DLROVER_MASTER_ADDR"], DLROVER_JOB_TOKEN="wrong"
    )
    r = dlrover_run(
        ["--nnodes", "2", str(SCRIPTS / "dump_env.py"), str(tmp_path)], env=env, timeout=60
    )
    assert r.returncode == 1
    assert "refused the job token" in r.stderr
    assert not list(tmp_path.glob("env.*"))


def test_master_port_in_use_is_a_clear_error(tmp_path: Path, master: MasterProcess):
    port = master.vars["DLROVER_MASTER_ADDR"].rsplit(":", 1)[1]
    r = subprocess.run(
        [*run_cmd("dlrover.cli.master"), "--port", port],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 1
    assert f"cannot listen on 0.0.0.0:{port}" in r.stderr and "in use" in r.stderr


def test_master_rejects_bad_nnodes():
    r = subprocess.run(
        [*run_cmd("dlrover.cli.master"), "--nnodes", "4:1"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2 and "MIN (4) is greater than MAX (1)" in r.stderr


def test_master_refuses_the_state_of_another_job_and_a_corrupt_one(tmp_path: Path):
    state = tmp_path / "state.db"
    owner = MasterProcess(tmp_path, "--state-db", str(state), "--token", "first")
    owner.close()  # SIGKILL: the state stays the first job's

    def master(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*run_cmd("dlrover.cli.master"), "--port", "0", *args],
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=30,
        )

    r = master("--state-db", str(state), "--token", "second")
    assert r.returncode == 1 and "belongs to job" in r.stderr and "another token" in r.stderr
    (tmp_path / "junk.db").write_bytes(b"junk" * 1000)
    r = master("--state-db", str(tmp_path / "junk.db"))
    assert r.returncode == 1 and "is not a DLRover state database, or it is corrupt" in r.stderr
    assert "Traceback" not in r.stderr
