"""`dlrover submit` on a real local Ray cluster: the job's master is a Ray actor; SIGKILLed
mid-training, Ray restarts it on its state (a real Redis), it adopts the running node actors,
no worker restarts, and the job ends with the model of a failure-free run."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, SCRIPTS, RedisServer, clean_env, redis_missing
from tests.engines.test_engine_ray import ray_cluster  # noqa: F401 - the fixture

pytestmark = [
    pytest.mark.extras,
    pytest.mark.xdist_group("ray"),  # one local Ray cluster at a time (.ci/run: -n 2)
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None,
        reason="ray is not installed (pip install 'dlrover[ray]')",
    ),
    pytest.mark.skipif(bool(redis_missing()), reason=redis_missing() or "redis is there"),
]


def _job_yaml(tmp: Path, name: str, steps: int, address: str, state: str) -> Path:
    (tmp / f"{name}-ckpt").mkdir()
    spec = {
        "name": name,
        "entrypoint": str(SCRIPTS / "oracle_train.py"),
        "args": [
            "--steps",
            str(steps),
            "--step-time",
            "0.2",
            "--ckpt",
            str(tmp / f"{name}-ckpt"),
            "--out",
            str(tmp / name),
        ],
        "nodes": 2,
        "nproc_per_node": 2,
        "resources": {"cpu": 1},
        "engine": "ray",
        "engine_settings": {"address": address, "state": state},
    }
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    return path


@pytest.mark.timeout(300)
def test_a_killed_master_actor_is_restarted_by_ray_and_the_job_goes_on(
    ray_cluster: Any,  # noqa: F811
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    from tests.e2e.test_fault_tolerance import final, steps_log

    steps = 30
    reference = subprocess.run(
        [
            sys.executable,
            "-m",
            "dlrover.cli.run",
            "--standalone",
            "--nproc-per-node=4",
            str(SCRIPTS / "oracle_train.py"),
            "--steps",
            str(steps),
            "--step-time",
            "0.01",
            "--ckpt",
            str(tmp_path),
            "--out",
            str(tmp_path / "ref"),
        ],
        env=clean_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert reference.returncode == 0, reference.stderr

    home = tmp_path / "home"
    spec = _job_yaml(tmp_path, "rayjob", steps, ray_cluster.address, redis_server.url)
    log_path = tmp_path / "submit.log"
    log = open(log_path, "w")  # noqa: SIM115 - a pipe nobody reads would block it
    job = subprocess.Popen(
        [sys.executable, "-m", "dlrover.cli.job", "submit", str(spec)],
        env=clean_env(DLROVER_HOME=str(home)),
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    out = tmp_path / "rayjob"
    try:
        steps_file = Path(f"{out}.steps")
        deadline = time.monotonic() + 150
        while not steps_file.exists() or len(steps_file.read_text().splitlines()) < 5:
            assert job.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, f"no step 5 within 150 s:\n{log_path.read_text()}"
            time.sleep(0.05)  # another process writes the file: nothing else to wait on
        again = subprocess.run(
            [sys.executable, "-m", "dlrover.cli.job", "submit", str(spec)],
            env=clean_env(DLROVER_HOME=str(tmp_path / "home2")),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert again.returncode == 1 and "already has a master actor 'rayjob-master'" in (
            again.stderr
        ), again.stderr
        record = json.loads((home / "jobs" / "rayjob" / "job.json").read_text())
        assert record["pid"] != job.pid  # the master is the actor, not the submitter
        os.kill(record["pid"], signal.SIGKILL)
        assert job.wait(180) == 0, log_path.read_text()
    finally:
        if job.poll() is None:
            job.send_signal(signal.SIGTERM)
            try:
                job.wait(30)
            except subprocess.TimeoutExpired:
                job.kill()
        log.close()
    text = log_path.read_text()
    assert f"pid {record['pid']}) is gone" in text and "runs again" in text, text
    assert text.count("adopting its running actor") == 2, text  # both nodes, no relaunch
    assert "launched by an earlier master" in text
    assert final(out) == final(tmp_path / "ref")
    assert [s for s, _, _ in steps_log(out)] == list(range(1, steps + 1))  # none twice, none lost
    # Nothing of the job is left on the cluster: no master actor, no node actor.
    import ray

    ray.init(address=ray_cluster.address, namespace="dlrover", log_to_driver=False)
    try:
        assert [n for n in ray.util.list_named_actors() if n.startswith("rayjob-")] == []
    finally:
        ray.shutdown()
    # The restarted master ended the job and recorded it.
    assert json.loads((home / "jobs" / "rayjob" / "job.json").read_text())["state"] == "succeeded"
