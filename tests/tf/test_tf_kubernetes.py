"""A TensorFlow job on Kubernetes, without TensorFlow and without a cluster: the operator turns an
ElasticJob with ``distributionStrategy: ParameterServerStrategy`` and ``replicaSpecs`` into the
master's job spec, and the master's TfController, through the Kubernetes engine against a fake
API server over real HTTP, creates a pod per role and index and relaunches an OOM-killed ps pod
with more memory."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dlrover.jobspec import job_spec_from_dict
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.relaunch_policy import OomPolicy
from dlrover.master.state_store import MemoryStateStore
from dlrover.master.tf_controller import TfController
from dlrover.operator.master_objects import job_spec_of, master_objects
from tests.conftest import REPO

EXAMPLE = REPO / "deploy" / "kubernetes" / "example-tf-elasticjob.yaml"
NS = "default"
OOM = {
    "phase": "Failed",
    "containerStatuses": [
        {"name": "main", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}
    ],
}


def _elastic_job() -> dict[str, Any]:
    job = yaml.safe_load(Path(EXAMPLE).read_text())
    job["metadata"]["uid"] = "uid-7"
    return dict(job)


def test_the_operator_reads_distribution_strategy_and_replica_specs() -> None:
    spec = job_spec_of(_elastic_job())
    assert spec.tf is not None and spec.engine == "kubernetes"
    assert {r: spec.tf.count(r) for r in spec.tf.roles} == {"chief": 1, "ps": 2, "worker": 2}
    ps = spec.tf.roles["ps"].resources  # from the pod template's limits
    assert (ps.cpu, ps.memory_mib) == (1.0, 2048)
    (_, config, *_) = master_objects(_elastic_job(), token="t")
    assert job_spec_from_dict(yaml.safe_load(config["data"]["job.yaml"])) == spec


def test_the_crd_knows_the_tensorflow_keys() -> None:
    (crd,) = [d for d in yaml.safe_load_all((EXAMPLE.parent / "crd.yaml").read_text()) if d]
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert set(_elastic_job()["spec"]) <= set(schema["properties"])


@pytest.fixture
def api() -> Iterator[Any]:
    from tests.engines.kube_fake_api import FakeKubeApi

    server = FakeKubeApi()
    yield server
    server.close()


def _until(condition: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.extras
@pytest.mark.skipif(
    importlib.util.find_spec("kubernetes") is None,
    reason="kubernetes is not installed (pip install 'dlrover[k8s]')",
)
def test_tensorflow_roles_become_pods_and_an_oom_killed_ps_grows(api: Any) -> None:
    from kubernetes import client

    from dlrover.engines.kube_manifests import PodSettings
    from dlrover.engines.kubernetes_engine import KubernetesEngine

    spec = job_spec_of(_elastic_job())
    config = client.Configuration()
    config.host = api.host
    engine = KubernetesEngine(
        client.ApiClient(config),
        spec.name,
        PodSettings(image="dlrover-tf:test", namespace=NS),
        watch_timeout_s=30,
        reconnect_delay_s=0.05,
    )
    job = JobMaster(JobMasterConfig(spec.name), MemoryStateStore())
    controller = TfController(
        job, engine, spec, "wide-deep-master:50001", "tok", oom_policy=OomPolicy(1.5, 4096)
    )
    try:
        controller.start()
        names = {p["metadata"]["name"] for p in api.pods(NS)}
        assert names == {
            "wide-deep-chief-0-0",
            "wide-deep-ps-0-0",
            "wide-deep-ps-1-0",
            "wide-deep-worker-0-0",
            "wide-deep-worker-1-0",
        }
        ps = api.pod(NS, "wide-deep-ps-1-0")
        assert ps["metadata"]["labels"]["dlrover.io/role"] == "ps"
        container = ps["spec"]["containers"][0]
        command = container.get("command", []) + container.get("args", [])
        assert command[:5] == ["dlrover-tf-node", "--role", "ps", "--index", "1"]
        assert "--host" in command and "0.0.0.0" in command  # a pod serves on its own address
        assert container["resources"]["limits"]["memory"] == "2048Mi"
        chief = api.pod(NS, "wide-deep-chief-0-0")["spec"]["containers"][0]
        chief_command = chief.get("command", []) + chief.get("args", [])
        assert chief_command[-3:] == [
            "/workspace/examples/tf_ps/wide_deep.py",
            "--out",
            "/checkpoints/wide-deep",
        ]
        api.set_pod_status(NS, "wide-deep-ps-1-0", OOM)

        def relaunched() -> bool:
            controller.step(0.1)
            return any(p["metadata"]["name"] == "wide-deep-ps-1-1" for p in api.pods(NS))

        _until(relaunched, "the ps pod's replacement")
        grown = api.pod(NS, "wide-deep-ps-1-1")["spec"]["containers"][0]
        assert grown["resources"]["limits"]["memory"] == "3072Mi"
        assert controller.relaunches == {"ps": 1}
    finally:
        engine.close()
