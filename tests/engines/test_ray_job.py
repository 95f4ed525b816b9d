"""A real training job on a real local Ray cluster: a Ray node dies, the node is relaunched on the
other Ray node by the master's controller, and the model equals the failure-free run's."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dlrover.jobspec import job_spec_from_flags
from dlrover.master.job import JobMaster, JobMasterConfig, JobState
from dlrover.master.node_controller import NodeController
from dlrover.master.rendezvous import RendezvousConfig
from dlrover.master.server import MasterServer
from dlrover.master.state_store import MemoryStateStore
from tests.conftest import REPO, SCRIPTS, clean_env, dlrover_run
from tests.engines.test_engine_ray import ray_cluster  # noqa: F401 - the fixture
from tests.stalls import process_report

pytestmark = [pytest.mark.extras, pytest.mark.xdist_group("ray")]  # one Ray cluster at a time
pytest.importorskip("ray", reason="the Ray engine needs `pip install ray`")


def _said(engine: Any) -> str:
    """Each node's state and the end of its agent's log (what a stuck start shows)."""
    logs = engine.logs()
    parts = []
    for node in engine.list_nodes():
        parts.append(f"--- {node.node_id}: {node.state.value} on {node.host or '?'}")
        tail = logs.tail(node.node_id, None, 40) if logs is not None else None
        parts.append(tail or "(no log)")
    return "\n".join(parts)


@pytest.mark.timeout(300)
def test_job_survives_a_lost_ray_node(ray_cluster: Any, tmp_path: Path, monkeypatch) -> None:  # noqa: F811
    from dlrover.engines.ray_engine import RayEngine

    steps, args = 40, ["--steps", "40", "--step-time", "0.25"]
    ref_out = tmp_path / "ref"
    (tmp_path / "ref-ckpt").mkdir()
    r = dlrover_run(
        [
            "--standalone",
            "--nproc-per-node=4",
            str(SCRIPTS / "oracle_train.py"),
            *args,
            "--ckpt",
            str(tmp_path / "ref-ckpt"),
            "--out",
            str(ref_out),
        ],
        env=clean_env(),
        timeout=120,
    )
    assert r.returncode == 0, r.stderr

    out = tmp_path / "ray"
    (tmp_path / "ray-ckpt").mkdir()
    for key, value in clean_env().items():
        monkeypatch.setenv(key, value)  # the Ray actors inherit the driver's environment
    monkeypatch.chdir(REPO)
    spec = job_spec_from_flags(
        str(SCRIPTS / "oracle_train.py"),
        [*args, "--ckpt", str(tmp_path / "ray-ckpt"), "--out", str(out)],
        nnodes="2",
        nproc_per_node=2,
        engine="ray",
        name="rayjob",
        cpu=1,
        max_restarts=3,
    )
    job = JobMaster(
        JobMasterConfig(job_name="rayjob", rendezvous=RendezvousConfig(2, 2)), MemoryStateStore()
    )
    server = MasterServer(job, "tok", "127.0.0.1", 0).start()
    engine = RayEngine(address=ray_cluster.address, stop_grace_s=1.0, launch_timeout_s=60)
    controller = NodeController(job, engine, spec, f"127.0.0.1:{server.port}", "tok")
    stop = threading.Event()
    runner = threading.Thread(target=controller.run, args=(stop,), daemon=True)
    try:
        controller.start()
        runner.start()
        deadline = time.monotonic() + 120
        steps_file = Path(f"{out}.steps")
        while not (steps_file.exists() and len(steps_file.read_text().splitlines()) >= 5):
            assert time.monotonic() < deadline, (
                f"training did not start on Ray:\n{_said(engine)}\n{process_report()}"
            )
            assert not job.lifecycle.ended.is_set(), job.lifecycle.reason
            time.sleep(0.2)
        hosts = {n.node_id: n.host for n in engine.list_nodes()}
        assert len(set(hosts.values())) == 2, f"nodes were not spread over Ray nodes: {hosts}"
        victim = next(
            n for n in ray_cluster.worker_nodes if n.node_id == hosts["rayjob-worker-1-0"]
        )
        ray_cluster.remove_node(victim, allow_graceful=False)
        assert job.lifecycle.ended.wait(180), "the job did not finish after the Ray node was lost"
        assert job.lifecycle.state == JobState.SUCCEEDED, job.lifecycle.reason
        assert controller.relaunches, "no node was relaunched"
    finally:
        stop.set()
        runner.join(30)
        server.stop(0.5)
    assert Path(f"{out}.final").read_text() == Path(f"{ref_out}.final").read_text()
    done = [int(line.split()[0]) for line in Path(f"{out}.steps").read_text().splitlines()]
    assert done == list(range(1, steps + 1))
    assert sys.platform.startswith("linux")


@pytest.mark.timeout(300)
def test_embedding_servers_run_as_ray_nodes(ray_cluster: Any, tmp_path: Path, monkeypatch) -> None:  # noqa: F811
    """A job with `--ps 2` on Ray: the master launches the dlrover-ps nodes as Ray actors (they
    listen on every interface and advertise the machine's address), the worker finds them
    through the master, and the model equals the one the same job trains on local processes."""
    from dlrover.engines.ray_engine import RayEngine
    from dlrover.master.ps_controller import PsController
    from tests.conftest import dlrover_cli

    example = REPO / "examples" / "train_embedding.py"
    args = ["--steps", "60"]
    # One intra-op thread on both sides: Ray sets OMP_NUM_THREADS to an actor's CPUs where it is
    # unset (1: the node asks for no more), and the MLP's sums over a batch split differently
    # on 2 threads (last bits differ), so the local reference job is given the same.
    ref = dlrover_cli(
        tmp_path / "home", "submit", "--name", "ref", "--ps", "2", str(example), *args,
        "--out", str(tmp_path / "ref"), timeout=240, OMP_NUM_THREADS="1",
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-4000:]

    for key, value in clean_env().items():
        monkeypatch.setenv(key, value)  # the Ray actors inherit the driver's environment
    monkeypatch.chdir(REPO)
    spec = job_spec_from_flags(
        str(example), [*args, "--out", str(tmp_path / "ray")], engine="ray", name="rayps", ps=2
    )
    job = JobMaster(
        JobMasterConfig(job_name="rayps", rendezvous=RendezvousConfig(1, 1)), MemoryStateStore()
    )
    server = MasterServer(job, "tok", "0.0.0.0", 0).start()
    engine = RayEngine(address=ray_cluster.address, stop_grace_s=1.0, launch_timeout_s=60)
    master_addr = f"127.0.0.1:{server.port}"
    controller = NodeController(job, engine, spec, master_addr, "tok")
    controller.ps = PsController(job, engine, spec, master_addr, "tok")
    stop = threading.Event()
    runner = threading.Thread(target=controller.run, args=(stop,), daemon=True)
    try:
        controller.ps.start()
        controller.start()
        runner.start()
        if not job.lifecycle.ended.wait(240):
            events = "\n".join(f"{kind}: {text}" for _, kind, text in job.diagnostics.events)
            pytest.fail(
                f"the job did not finish on Ray\n{events}\n{_said(engine)}\n{process_report()}"
            )
        assert job.lifecycle.state == JobState.SUCCEEDED, job.lifecycle.reason
        addresses = controller.ps.addresses
        assert len(addresses) == 2 and not any(a.startswith("0.0.0.0") for a in addresses)
    finally:
        stop.set()
        runner.join(30)
        controller.ps.close()
        server.stop(0.5)
    import torch

    got, want = torch.load(tmp_path / "ray.pt"), torch.load(tmp_path / "ref.pt")
    assert torch.equal(got["deep"], want["deep"]) and torch.equal(got["wide"], want["wide"])
    for key, value in want["mlp"].items():
        assert torch.equal(got["mlp"][key], value), key
