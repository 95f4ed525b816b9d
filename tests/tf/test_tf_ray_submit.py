"""`dlrover submit` of a TensorFlow parameter-server job on a real local Ray cluster, end to end:
the master is a Ray actor, chief, ps and workers are Ray actors running real TensorFlow
processes; the job succeeds with every sample trained once, and the CLI reads it as a user
would (status while it runs and after, the chief's log)."""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import REPO, clean_env, dlrover_cli
from tests.engines.test_engine_ray import ray_cluster  # noqa: F401 - the fixture

pytestmark = [
    pytest.mark.extras,
    pytest.mark.xdist_group("ray"),  # one local Ray cluster at a time (.ci/run: -n 2)
    pytest.mark.skipif(
        importlib.util.find_spec("tensorflow") is None,
        reason="TensorFlow is not installed: pip install tensorflow-cpu==2.21.0",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None, reason="the Ray engine needs `pip install ray`"
    ),
]

EXAMPLE = REPO / "examples" / "tf_ps" / "wide_deep.py"


@pytest.mark.timeout(400)
def test_dlrover_submit_runs_a_tf_ps_job_on_ray_to_its_end(
    ray_cluster: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    home, out = tmp_path / "home", tmp_path / "out"
    role = {"count": 1, "resources": {"cpu": 0.5}}
    spec = {
        "name": "raytfsub",
        "engine": "ray",
        "engine_settings": {"address": ray_cluster.address},
        "distribution_strategy": "ParameterServerStrategy",
        "entrypoint": str(EXAMPLE),
        "args": ["--out", str(out), "--shard-delay", "0.2"],
        "roles": {"chief": role, "ps": {**role, "count": 2}, "worker": {**role, "count": 2}},
    }
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    log_path = tmp_path / "submit.log"
    log = open(log_path, "w")  # noqa: SIM115 - a pipe nobody reads would block it
    job = subprocess.Popen(
        [sys.executable, "-m", "dlrover.cli.job", "submit", str(path)],
        env=clean_env(DLROVER_HOME=str(home)),
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        progress = out / "progress"
        deadline = time.monotonic() + 240
        while not (progress.exists() and len(progress.read_text().splitlines()) >= 3):
            assert job.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.5)  # the chief writes the file: nothing else to wait on
        running = dlrover_cli(home, "status", "raytfsub").stdout
        assert "job raytfsub: running" in running, running
        assert re.search(r"ps +0=\S+:\d+  1=\S+:\d+", running), running  # the cluster spec
        chief = dlrover_cli(home, "logs", "raytfsub", "--node", "raytfsub-chief-0-0", "-n", "2000")
        assert chief.returncode == 0, chief.stderr
        # The chief's own log, read by its actor: dlrover-tf-node's lines, then the script's.
        assert "chief 0: cluster spec version" in chief.stdout, chief.stdout[-3000:]
        assert "strategy over 2 ps and 2 workers" in chief.stdout, chief.stdout[-3000:]
        ps = dlrover_cli(home, "logs", "raytfsub", "--node", "raytfsub-ps-1-0", "-n", "2000")
        assert "raytfsub-ps-1-0 registered" in ps.stdout, ps.stdout[-3000:] + ps.stderr
        assert job.wait(240) == 0, log_path.read_text()[-4000:]
    finally:
        if job.poll() is None:
            job.send_signal(signal.SIGTERM)
            try:
                job.wait(30)
            except subprocess.TimeoutExpired:
                job.kill()
        log.close()
    with np.load(out / "model.npz") as model:
        assert (model["seen"] == 1).all(), np.flatnonzero(model["seen"] != 1)[:20]
    ended = dlrover_cli(home, "status", "raytfsub").stdout
    assert ended.startswith("job raytfsub: succeeded"), ended
    assert "failures: none" in ended, ended
