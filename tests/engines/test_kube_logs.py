"""Per-rank logs of Kubernetes pods: a real agent's console (its workers' lines echoed with rank
tags) served as a pod's log by the fake API, read by the engine, the master's dashboard and
`dlrover logs` (subprocess, as a user runs it)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dlrover.api.master import NodeLimits, Registration
from dlrover.client.master_client import MasterClient
from dlrover.constants import ENV_RANK_LOG_DIR, ENV_RANK_LOG_ECHO
from dlrover.engines.kube_manifests import PodSettings
from dlrover.master.assembly import MasterSettings, build_master
from dlrover.runner.records import JobRecord, write_record
from tests.conftest import REPO, SCRIPTS, clean_env, run_cmd

pytestmark = [
    pytest.mark.extras,
    pytest.mark.skipif(
        importlib.util.find_spec("kubernetes") is None,
        reason="kubernetes is not installed (pip install 'dlrover[k8s]')",
    ),
]

NS = "train"
POD = "kjob-worker-0-0"


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory) -> str:
    """What a pod's container prints: a real dlrover-run with 2 workers of chatty.py, told to
    keep per-rank files and echo them (as the Kubernetes engine tells its pods)."""
    tmp = tmp_path_factory.mktemp("agent")
    done = subprocess.run(
        [*run_cmd("dlrover.cli.run"), "--standalone", "--nproc-per-node", "2",
         str(SCRIPTS / "chatty.py"), str(tmp / "out"), "4", "0.02"],
        env=clean_env(**{ENV_RANK_LOG_DIR: str(tmp / "ranks"), ENV_RANK_LOG_ECHO: "1"}),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout
    return done.stdout


@pytest.fixture
def kube(console: str) -> Iterator[tuple[Any, Any]]:
    from kubernetes import client

    from dlrover.engines.kubernetes_engine import KubernetesEngine
    from tests.engines.kube_fake_api import FakeKubeApi

    api = FakeKubeApi()
    api.pod_logs[(NS, POD)] = console
    config = client.Configuration()
    config.host = api.host
    engine = KubernetesEngine(
        client.ApiClient(config), "kjob", PodSettings(image="dlrover:test", namespace=NS)
    )
    try:
        yield api, engine
    finally:
        engine.close(delete_nodes=False)
        api.close()


def test_the_agent_echoes_each_ranks_lines_tagged(console: str) -> None:
    for rank in (0, 1):
        mine = [line for line in console.splitlines() if line.startswith(f"[rank {rank}] ")]
        assert [line for line in mine if " step=" in line] == [
            f"[rank {rank}] chatty rank={rank} attempt=0 step={s}" for s in range(4)
        ]
    assert "dlrover.agent" in console  # and the agent's own lines, untagged


def test_the_engine_reads_a_pods_log_by_rank(kube: tuple[Any, Any]) -> None:
    api, engine = kube
    logs = engine.logs()
    assert logs.ranks(POD) == (0, 1)
    assert logs.tail(POD, 1, 2) == "chatty rank=1 attempt=0 step=2\nchatty rank=1 attempt=0 step=3"
    own = logs.tail(POD, None, 50)
    assert "dlrover.agent" in own and "chatty rank=" not in own
    assert logs.tail(POD, 5, 10) is None and logs.tail("kjob-worker-9-0", None, 5) is None
    end = logs.read(POD, 0, "stdout", -1)
    assert end is not None and end.text == ""
    api.pod_logs[(NS, POD)] += "[rank 1] other\n[rank 0] new line\nagent line\n"
    chunk = logs.read(POD, 0, "stdout", end.offset)
    assert chunk is not None and chunk.text == "new line\n"  # only rank 0's, only what is new


def test_dashboard_and_dlrover_logs_serve_a_pods_ranks(
    kube: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    api, engine = kube
    monkeypatch.setenv("DLROVER_HOME", str(tmp_path))  # where write_record puts the record
    master = build_master(
        MasterSettings(job_name="kjob", token="tok", host="127.0.0.1", log_reader=engine.logs())
    )
    client = MasterClient(f"127.0.0.1:{master.port}", "tok")
    follower: subprocess.Popen[str] | None = None
    try:
        # The pod's agent registers under the pod's name, as the engine names it.
        client.register_node(
            Registration(host="10.0.0.7", local_world_size=2, node_id=POD, limits=NodeLimits(1, 1))
        )
        write_record(
            JobRecord("kjob", "running", os.getpid(), f"127.0.0.1:{master.port}", "tok",
                      engine="kubernetes"),
        )  # fmt: skip
        assert master.web is not None
        base = f"http://127.0.0.1:{master.web.port}"
        assert json.loads(urllib.request.urlopen(f"{base}/api/log/ranks?node={POD}").read()) == [
            0,
            1,
        ]
        page = urllib.request.urlopen(f"{base}/api/log?node={POD}&rank=0&lines=1").read()
        assert page.decode() == "chatty rank=0 attempt=0 step=3"

        env = clean_env(DLROVER_HOME=str(tmp_path))
        r = subprocess.run(
            [*run_cmd("dlrover.cli.job"), "logs", "kjob", "--rank", "1", "-n", "3"],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == [f"chatty rank=1 attempt=0 step={s}" for s in (1, 2, 3)]
        r = subprocess.run(
            [*run_cmd("dlrover.cli.job"), "logs", "kjob", "--rank", "4"],
            env=env, cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode == 1 and "ranks with logs: 0, 1" in r.stderr

        # -f: lines the pod prints later come out once, then the job's end ends it.
        follower = subprocess.Popen(
            [*run_cmd("dlrover.cli.job"), "logs", "kjob", "--rank", "1", "-f", "-n", "1"],
            env=env, cwd=REPO, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert follower.stdout is not None
        assert follower.stdout.readline() == "chatty rank=1 attempt=0 step=3\n"
        api.pod_logs[(NS, POD)] += "[rank 1] later 1\n[rank 0] not mine\n[rank 1] later 2\n"
        assert follower.stdout.readline() == "later 1\n"
        assert follower.stdout.readline() == "later 2\n"
        write_record(JobRecord("kjob", "succeeded", os.getpid()))
        assert follower.wait(30) == 0
    finally:
        if follower is not None and follower.poll() is None:
            follower.kill()
            follower.wait(10)
        client.close()
        master.stop(0.5)
