"""`dlrover submit | status | stop` on the local engine: a job's whole life from the CLI."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, SCRIPTS, clean_env, dlrover_cli
from tests.stalls import process_report

dlrover = dlrover_cli


@pytest.mark.e2e
def test_status_shows_progress_and_stop_ends_the_job(tmp_path: Path):
    home = tmp_path / "home"
    (tmp_path / "ck").mkdir()
    log = open(tmp_path / "submit.log", "w")  # noqa: SIM115 - a pipe nobody reads would block it
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dlrover.cli.job",
            "submit",
            "--name",
            "long",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            str(SCRIPTS / "oracle_train.py"),
            "--steps",
            "100000",
            "--ckpt",
            str(tmp_path / "ck"),
            "--out",
            str(tmp_path / "out"),
            "--step-time",
            "0.05",
        ],
        env=clean_env(DLROVER_HOME=str(home)),
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            status = (
                dlrover(home, "status", "long")
                if (home / "jobs" / "long" / "job.json").exists()
                else None
            )
            if status is not None and status.returncode == 0:
                lines = status.stdout.splitlines()
                header = next((i for i, line in enumerate(lines) if line.startswith("node ")), 0)
                rows = [line.split() for line in lines[header + 1 :]]
                if len(rows) == 2 and all(r[2] == "running" and int(r[3]) >= 1 for r in rows):
                    break
            assert job.poll() is None, (tmp_path / "submit.log").read_text()
            if time.monotonic() > deadline:
                nodes = sorted((home / "jobs" / "long" / "nodes").glob("*/stderr"))
                tails = "".join(f"== {p}\n{p.read_text()[-2000:]}" for p in nodes)
                said = (status.stdout if status else "no job record") + tails
                raise AssertionError(f"{said}\n{process_report()}")
            time.sleep(0.5)
        assert "job long: running" in status.stdout
        stopped = dlrover(home, "stop", "long")
        assert stopped.returncode == 0, stopped.stderr
        assert job.wait(30) != 0  # a stopped job did not succeed
        record = json.loads((home / "jobs" / "long" / "job.json").read_text())
        assert record["state"] == "failed" and "dlrover stop" in record["reason"]
        assert "already ended" in dlrover(home, "stop", "long").stdout
    finally:
        if job.poll() is None:  # a failed check: end the job's nodes too, not only `submit`
            with contextlib.suppress(subprocess.TimeoutExpired):
                dlrover(home, "stop", "long", "--timeout", "20")
            job.kill()
        log.close()


def test_bad_job_specs_get_one_clear_error(tmp_path: Path):
    spec = tmp_path / "job.yaml"
    spec.write_text("entrypoint: train.py\nnodes: '4:2'\n")
    r = dlrover(tmp_path / "home", "submit", str(spec))
    assert r.returncode == 2 and "MIN (4) is greater than MAX (2)" in r.stderr
    spec.write_text("entrypoint: train.py\nengine: slurm\n")
    r = dlrover(tmp_path / "home", "submit", str(spec))
    assert r.returncode == 2 and "slurm" in r.stderr
    r = dlrover(tmp_path / "home", "status", "nope")
    assert r.returncode != 0 and "no job named 'nope'" in r.stderr


@pytest.mark.e2e
def test_a_killed_master_is_restarted_by_submit_and_the_job_goes_on(tmp_path: Path):
    """SIGKILL of the job's master mid-training: `dlrover submit` starts it again on the same
    port, token and state; it adopts the running nodes (no second copy, no worker restart) and
    the job ends normally with the model of a failure-free run."""
    from tests.e2e.test_fault_tolerance import final, steps_log, submit

    steps = 30
    reference, ref_out = submit(tmp_path, "ref", "2", steps, step_time=0.1)
    assert reference.returncode == 0

    home = tmp_path / "home"
    out, ckpt = tmp_path / "killed", tmp_path / "killed-ckpt"
    ckpt.mkdir()
    log = open(tmp_path / "submit.log", "w")  # noqa: SIM115 - a pipe nobody reads would block it
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dlrover.cli.job",
            "submit",
            "--name",
            "killed",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            str(SCRIPTS / "oracle_train.py"),
            "--steps",
            str(steps),
            "--ckpt",
            str(ckpt),
            "--out",
            str(out),
            "--step-time",
            "0.1",
        ],
        env=clean_env(DLROVER_HOME=str(home)),
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        steps_file = Path(f"{out}.steps")
        deadline = time.monotonic() + 120
        while not steps_file.exists() or len(steps_file.read_text().splitlines()) < 5:
            assert job.poll() is None, (tmp_path / "submit.log").read_text()
            assert time.monotonic() < deadline, "no step 5 within 120 s"
            time.sleep(0.05)  # another process writes the file: nothing else to wait on
        master_pid = json.loads((home / "jobs" / "killed" / "job.json").read_text())["pid"]
        assert master_pid != job.pid  # the master is submit's child
        import os
        import signal

        os.kill(master_pid, signal.SIGKILL)
        assert job.wait(180) == 0, (tmp_path / "submit.log").read_text()
    finally:
        if job.poll() is None:
            job.kill()
        log.close()
    text = (tmp_path / "submit.log").read_text()
    assert "was killed by SIGKILL; starting it again on its state (1/3)" in text
    assert "adopted the running pid" in text
    assert final(out) == final(ref_out)
    assert [s for s, _, _ in steps_log(out)] == list(range(1, steps + 1))  # none twice, none lost
    nodes = sorted((home / "jobs" / "killed" / "nodes").iterdir())
    assert len(nodes) == 2  # the same two nodes: none relaunched
    for node in nodes:  # workers started once: the master's death did not restart them
        assert (node / "stderr").read_text().count("started 2 workers") == 1


@pytest.mark.e2e
def test_a_master_killed_during_a_node_replacement_launches_it_after_its_restart(tmp_path: Path):
    """An agent dies; the master decides to replace its node (relaunch delay 3 s) and is
    SIGKILLed before it launches the replacement. The restarted master launches the saved
    attempt at once (not the dead one again, not a duplicate), and the job ends with the model of
    a failure-free run."""
    import os
    import signal

    from tests.e2e.test_fault_tolerance import final, steps_log, submit

    steps = 16
    reference, ref_out = submit(tmp_path, "ref", "2", steps, step_time=0.1)
    assert reference.returncode == 0

    home = tmp_path / "home"
    out, ckpt, marker = tmp_path / "replaced", tmp_path / "replaced-ckpt", tmp_path / "fired"
    ckpt.mkdir()
    log_path = tmp_path / "submit.log"
    log = open(log_path, "w")  # noqa: SIM115 - a pipe nobody reads would block it
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dlrover.cli.job",
            "submit",
            "--name",
            "replaced",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--relaunch-delay",
            "3",
            str(SCRIPTS / "oracle_train.py"),
            "--steps",
            str(steps),
            "--ckpt",
            str(ckpt),
            "--out",
            str(out),
            "--step-time",
            "0.1",
        ],
        env=clean_env(
            DLROVER_HOME=str(home), DLROVER_FAULTS=f"kill_agent:rank=2:step=8:once={marker}"
        ),
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        # The replacement's attempt is in the state once this is logged (the decision's own
        # line comes before it is saved: a master killed in between relaunches the old one).
        while ": saved, launching in " not in log_path.read_text():
            assert job.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "no relaunch decision within 120 s"
            time.sleep(0.05)  # another process writes the log: nothing else to wait on
        os.kill(
            json.loads((home / "jobs" / "replaced" / "job.json").read_text())["pid"], signal.SIGKILL
        )
        assert job.wait(180) == 0, log_path.read_text()
    finally:
        if job.poll() is None:
            job.kill()
        log.close()
    text = log_path.read_text()
    nodes = sorted(p.name for p in (home / "jobs" / "replaced" / "nodes").iterdir())
    # Both first attempts and one replacement (of whichever slot held rank 2), nothing more.
    (replacement,) = [n for n in nodes if n.endswith("-1") and n.count("-") == 3]
    assert len(nodes) == 3 and {"replaced-worker-0-0", "replaced-worker-1-0"} <= set(nodes)
    assert marker.exists() and f"resumed attempts: {replacement}" in text
    assert final(out) == final(ref_out)
    assert [s for s, _, _ in steps_log(out)] == list(range(1, steps + 1))
