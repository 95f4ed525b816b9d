"""A TensorFlow parameter-server job on a real local Ray cluster (two Ray nodes): the master's
TfController launches chief, ps and workers as Ray actors, a ps process is SIGKILLed, relaunched
on its address by the controller, and the chief recovers in place; every sample once."""

from __future__ import annotations

import importlib.util
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from dlrover.jobspec import job_spec_from_dict
from dlrover.master.job import JobMaster, JobMasterConfig, JobState
from dlrover.master.server import MasterServer
from dlrover.master.state_store import MemoryStateStore
from dlrover.master.tf_controller import TfController
from tests.conftest import REPO, clean_env
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


def _node_process(node_id: str) -> psutil.Process | None:
    """The process a Ray actor runs for ``node_id`` (its environment names it)."""
    for process in psutil.process_iter(["cmdline"]):
        try:
            if "dlrover.trainer.tf.server" not in " ".join(process.info["cmdline"] or []):
                continue
            if process.environ().get("DLROVER_NODE_NAME") == node_id:
                return process
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


@pytest.mark.timeout(240)
def test_a_ps_killed_on_ray_is_relaunched_and_the_chief_recovers(
    ray_cluster: Any,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dlrover.engines.ray_engine import RayEngine

    for key, value in clean_env().items():
        monkeypatch.setenv(key, value)  # the Ray actors inherit the driver's environment
    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    role = {"count": 1, "resources": {"cpu": 0.5}}
    spec = job_spec_from_dict(
        {
            "name": "raytf",
            "engine": "ray",
            "distribution_strategy": "ParameterServerStrategy",
            "entrypoint": str(EXAMPLE),
            "args": ["--out", str(out), "--shard-delay", "0.4"],
            "roles": {"chief": role, "ps": {**role, "count": 2}, "worker": {**role, "count": 2}},
        }
    )
    job = JobMaster(JobMasterConfig(job_name="raytf"), MemoryStateStore())
    server = MasterServer(job, "tok", "127.0.0.1", 0).start()
    engine = RayEngine(address=ray_cluster.address, stop_grace_s=1.0, launch_timeout_s=60)
    controller = TfController(job, engine, spec, f"127.0.0.1:{server.port}", "tok")
    stop = threading.Event()
    runner = threading.Thread(target=controller.run, args=(stop,), daemon=True)
    try:
        controller.start()
        runner.start()
        progress = out / "progress"
        deadline = time.monotonic() + 150
        while not (progress.exists() and len(progress.read_text().splitlines()) >= 5):
            assert time.monotonic() < deadline, "training did not start on Ray"
            assert not job.lifecycle.ended.is_set(), job.lifecycle.reason
            time.sleep(0.2)
        hosts = {n.node_id: n.host for n in engine.list_nodes()}
        assert len(set(hosts.values())) == 2, f"nodes were not spread over Ray nodes: {hosts}"
        victim = _node_process("raytf-ps-1-0")
        assert victim is not None, "the ps process was not found"
        victim.kill()
        assert job.lifecycle.ended.wait(150), "the job did not finish after the ps was killed"
        assert job.lifecycle.state == JobState.SUCCEEDED, job.lifecycle.reason
        assert controller.relaunches == {"ps": 1}
    finally:
        stop.set()
        runner.join(30)
        server.stop(0.5)
    with np.load(out / "model.npz") as model:
        assert (model["seen"] == 1).all(), np.flatnonzero(model["seen"] != 1)[:20]
    report = (out / "report.json").read_text()
    assert '"kind": "ps_lost"' in report, report
    # Each node's actor swept what its killed process left (TensorFlow's temp folders).
    left = list(Path(tempfile.gettempdir()).glob("dlrover.raytf.*"))
    assert not left, left
