"""Ray engine on a real local Ray cluster of two Ray nodes: lose one, relaunch, adopt the nodes
from a new engine (a restarted master), finish correctly."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dlrover.engines.base import FailureReason, NodeEvent, NodeSpec, NodeState, wait_for_event

pytestmark = [
    pytest.mark.extras,
    pytest.mark.xdist_group("ray"),  # one local Ray cluster at a time (.ci/run: -n 2)
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None,
        reason="ray is not installed (pip install 'dlrover[ray]')",
    ),
]

# Same tiny job as the local-engine test: each node sums the squares of its share of 0..n-1
# once the go file exists, and writes its partial sum atomically.
NODE_SCRIPT = """
import os, sys, time
rank, nnodes, n, workdir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(workdir, "go")):
    if time.monotonic() > deadline:
        sys.exit(7)
    time.sleep(0.02)
total = sum(i * i for i in range(rank, n, nnodes))
tmp = os.path.join(workdir, f"part-{rank}.tmp")
with open(tmp, "w") as f:
    f.write(str(total))
os.replace(tmp, os.path.join(workdir, f"part-{rank}"))
"""


@pytest.fixture
def ray_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A head with no CPUs (nothing lands there) and two 2-CPU Ray nodes, all on 127.0.0.1."""
    # Short per-test temp dir: Ray's unix socket paths must stay under 108 bytes.
    tmpdir = f"/tmp/dlrt-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    os.makedirs(tmpdir)
    monkeypatch.setenv("RAY_TMPDIR", tmpdir)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    # Keep every address on loopback instead of the machine's routable IP. Ray reads this when
    # it is first imported, hence the import below; if an earlier test imported ray already,
    # set the value Ray derived from it.
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray._private.ray_constants as ray_constants
    from ray.cluster_utils import Cluster

    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    # Detect a dead raylet in ~2 s instead of the default ~15 s.
    monkeypatch.setenv("RAY_health_check_period_ms", "500")
    monkeypatch.setenv("RAY_health_check_timeout_ms", "500")
    monkeypatch.setenv("RAY_health_check_failure_threshold", "3")
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False}
    )
    try:
        cluster.add_node(num_cpus=2)
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes(timeout=60)
        yield cluster
    finally:
        # Cluster.shutdown stops exactly the processes this cluster started, by PID.
        cluster.shutdown()
        shutil.rmtree(tmpdir, ignore_errors=True)


@pytest.mark.timeout(180)
def test_lost_ray_node_is_relaunched_elsewhere_and_job_result_is_correct(
    ray_cluster: Any, tmp_path: Path
) -> None:
    from dlrover.engines.ray_engine import RayEngine

    nnodes, n = 2, 10_000
    workdir = tmp_path / "work"
    workdir.mkdir()

    def spec(rank: int, attempt: int = 0) -> NodeSpec:
        return NodeSpec(
            job_name="rayjob",
            rank=rank,
            relaunch_count=attempt,
            command=(
                sys.executable,
                "-c",
                NODE_SCRIPT,
                str(rank),
                str(nnodes),
                str(n),
                str(workdir),
            ),
            env={"PYTHONUNBUFFERED": "1"},
        )

    engine = RayEngine(address=ray_cluster.address, stop_grace_s=1.0, launch_timeout_s=60)
    try:
        engine.launch_many([spec(rank) for rank in range(nnodes)])
        seen: list[NodeEvent] = []
        wait_for_event(  # one drain may bring both events: read them from `seen`
            engine,
            lambda e: sum(x.state is NodeState.RUNNING for x in seen) == nnodes,
            60,
            seen,
        )
        hosts = {e.node_id: e.host for e in seen if e.state is NodeState.RUNNING}
        assert len(set(hosts.values())) == 2, f"nodes were not spread over Ray nodes: {hosts}"

        victim_host = hosts["rayjob-worker-1-0"]
        victim = next(node for node in ray_cluster.worker_nodes if node.node_id == victim_host)
        ray_cluster.remove_node(victim, allow_graceful=False)  # SIGKILLs its processes by PID

        lost = wait_for_event(engine, lambda e: e.state.is_final, 60, seen)
        assert lost.node_id == "rayjob-worker-1-0", str(lost)
        assert (lost.state, lost.reason) == (NodeState.FAILED, FailureReason.NODE_LOST)

        engine.launch(spec(1, attempt=1))
        moved = wait_for_event(
            engine,
            lambda e: e.node_id == "rayjob-worker-1-1" and e.state is not NodeState.PENDING,
            60,
            seen,
        )
        assert moved.state is NodeState.RUNNING, str(moved)
        assert moved.host == hosts["rayjob-worker-0-0"]  # the only Ray node left

        # The master goes away (its engine closes, keeping the nodes, and disconnects from
        # Ray); a new engine launching the same node ids adopts the running actors.
        started = {e.node_id: e.message for e in seen if e.state is NodeState.RUNNING}
        engine.close(delete_nodes=False)
        engine = RayEngine(address=ray_cluster.address, stop_grace_s=1.0, launch_timeout_s=60)
        adopted = engine.launch_many([spec(0), spec(1, attempt=1)])
        assert {n.node_id for n in adopted} == {"rayjob-worker-0-0", "rayjob-worker-1-1"}
        seen = []
        wait_for_event(  # one drain may bring both events: read them from `seen`
            engine,
            lambda e: sum(x.state is NodeState.RUNNING for x in seen) == 2,
            60,
            seen,
        )
        running = {e.node_id: e.message for e in seen if e.state is NodeState.RUNNING}
        # The same processes ("pid P on HOST"), not second copies.
        assert running == {k: started[k] for k in ("rayjob-worker-0-0", "rayjob-worker-1-1")}
        assert not any(e.state.is_final for e in seen), seen  # nothing restarted or lost

        (workdir / "go").touch()
        done: set[str] = set()
        while done != {"rayjob-worker-0-0", "rayjob-worker-1-1"}:
            event = wait_for_event(engine, lambda e: e.state.is_final, 60, seen)
            assert event.state is NodeState.SUCCEEDED, str(event)
            done.add(event.node_id)
    finally:
        engine.close()
    result = sum(int((workdir / f"part-{rank}").read_text()) for rank in range(nnodes))
    assert result == sum(i * i for i in range(n))
