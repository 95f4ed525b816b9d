"""A training job as the sink of a Ray Data pipeline: ElasticStreamDataset(RayDataSource(ds))
under dlrover-run, on a real local Ray cluster, through a worker SIGKILL; each mode's promise
holds as with Kafka (the same stream machinery, another source)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, SCRIPTS, clean_env, dlrover_run
from tests.e2e.test_stream_job import assert_mode_kept
from tests.engines.test_engine_ray import ray_cluster  # noqa: F401 - the fixture

pytestmark = [pytest.mark.extras, pytest.mark.xdist_group("ray")]  # one Ray cluster at a time
pytest.importorskip("ray.data", reason="RayDataSource needs `pip install 'ray[data]'`")


def _run(cluster: Any, tmp_path: Path, n: int, **env: str) -> tuple[Any, Path]:
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    once = tmp_path / "fault.once"
    r = dlrover_run(
        [
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            str(SCRIPTS / "stream_train.py"),
            "--ray-address",
            cluster.address,
            "--records",
            str(n),
            "--end",
            "0",
            "--batch",
            "3",
            "--records-per-shard",
            "5",
            "--ckpt",
            str(ckpt),
            "--out",
            str(out),
        ],  # fmt: skip
        env=clean_env(DLROVER_FAULTS=f"kill:rank=1:step=7:once={once}", **env),
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "dlrover fault injection: kill rank 1 step 7" in r.stderr
    return r, out


def test_rows_of_a_ray_data_pipeline_are_trained_exactly_once_through_a_worker_kill(
    ray_cluster: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    """Rank 1 is SIGKILLed at step 7; every rank restarts from the flash checkpoint of step 6
    and restores the stream's position: each row of the 7-block dataset is trained once, and
    the pipeline ran once (its holder materialized it; the restarted ranks read its blocks)."""
    import ray

    n = 120
    r, out = _run(ray_cluster, tmp_path, n)
    seen = json.loads((out / "seen.json").read_text())
    assert seen == [1] * n, {i: c for i, c in enumerate(seen) if c != 1}
    loads = sorted(line.split() for line in (out / "loads").read_text().splitlines())
    assert loads == [["0", "0", "1"], ["0", "1", "7"], ["1", "0", "1"], ["1", "1", "7"]]
    produced = (out / "pipeline").read_text().split()
    assert sorted(int(i) for i in produced) == list(range(n))  # the pipeline ran once
    # Rank 0 released the holder at the end: nothing of the job is left in the cluster.
    ray.init(address=ray_cluster.address, log_to_driver=False, logging_level="ERROR")
    try:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        assert not [name for name in names if name.startswith("dlrover-data-")], names
    finally:
        ray.shutdown()


@pytest.mark.timeout(400)
def test_a_lost_node_s_replacement_goes_on_with_the_rows_exactly_once(
    ray_cluster: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    """`dlrover submit` of 2 nodes; node 1 loses its machine at step 7 (agent SIGKILLed, its
    shared memory gone). The replacement and the survivor resume from a checkpoint both can
    load; the stream's position comes with it: every row once."""
    n, out = 120, tmp_path / "out"
    out.mkdir()
    marker = tmp_path / "fired"
    r = subprocess.run(
        [
            sys.executable, "-m", "dlrover.cli.job", "submit", "--name", "raydata",
            "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "2",
            "--relaunch-delay", "0", str(SCRIPTS / "stream_train.py"),
            "--ray-address", ray_cluster.address, "--records", str(n), "--end", "0",
            "--batch", "3", "--records-per-shard", "5", "--ckpt", str(tmp_path / "ckpt"),
            "--out", str(out),
        ],
        env=clean_env(
            DLROVER_HOME=str(tmp_path / "home"),
            DLROVER_FAULTS=f"lose_node:rank=1:step=7:once={marker}",
        ),
        cwd=REPO, capture_output=True, text=True, timeout=360,
    )  # fmt: skip
    logs = "".join(p.read_text()[-3000:] for p in (tmp_path / "home").glob("jobs/*/nodes/*/stderr"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:] + logs
    assert marker.exists()
    seen = json.loads((out / "seen.json").read_text())
    assert seen == [1] * n, {i: c for i, c in enumerate(seen) if c != 1}
    # The lost node (the slot of global rank 1, either one) was relaunched once.
    nodes = sorted(p.name for p in (tmp_path / "home/jobs/raydata/nodes").iterdir())
    assert len(nodes) == 3 and sum(name.endswith("-1") for name in nodes) == 1, nodes


@pytest.mark.parametrize("mode", ["at-most-once", "at-least-once"])
def test_the_other_modes_keep_their_promise_on_a_ray_data_stream(
    ray_cluster: Any,  # noqa: F811
    tmp_path: Path,
    mode: str,
) -> None:
    """At most once: none twice, the loss counted exactly; at least once: none lost."""
    n = 120
    _, out = _run(ray_cluster, tmp_path, n, DLROVER_DELIVERY_MODE=mode)
    assert_mode_kept(mode, out)
