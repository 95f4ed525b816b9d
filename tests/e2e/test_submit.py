"""`dlrover submit | status | stop` on the local engine: a job's whole life from the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO, SCRIPTS, clean_env


def dlrover(home: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dlrover.cli.job", *args],
        env=clean_env(DLROVER_HOME=str(home)),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


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
                rows = [line.split() for line in status.stdout.splitlines()[2:]]
                if len(rows) == 2 and all(r[2] == "running" and int(r[3]) >= 1 for r in rows):
                    break
            assert job.poll() is None, (tmp_path / "submit.log").read_text()
            assert time.monotonic() < deadline, status.stdout if status else "no job record"
            time.sleep(0.5)
        assert "job long: running" in status.stdout
        stopped = dlrover(home, "stop", "long")
        assert stopped.returncode == 0, stopped.stderr
        assert job.wait(30) != 0  # a stopped job did not succeed
        record = json.loads((home / "jobs" / "long" / "job.json").read_text())
        assert record["state"] == "failed" and "dlrover stop" in record["reason"]
        assert "already ended" in dlrover(home, "stop", "long").stdout
    finally:
        if job.poll() is None:
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
