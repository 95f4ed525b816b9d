"""deploy/kubernetes manifests parse and agree with the code; the operator's master objects."""

from __future__ import annotations

import base64
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import yaml

from dlrover.jobspec import JobSpecError, job_spec_from_dict
from dlrover.operator.master_objects import job_spec_of, master_objects

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def _docs(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((DEPLOY / name).read_text()) if doc]


def _example() -> dict[str, Any]:
    (job,) = _docs("example-elasticjob.yaml")
    job["metadata"]["uid"] = "uid-42"
    return job


def test_every_manifest_parses_with_kind_and_name() -> None:
    kinds: dict[str, list[str]] = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in _docs(path.name):
            assert doc["apiVersion"] and doc["metadata"]["name"], path.name
            kinds.setdefault(doc["kind"], []).append(doc["metadata"]["name"])
    assert {
        "CustomResourceDefinition",
        "ClusterRole",
        "Role",
        "Deployment",
        "Job",
        "ElasticJob",
        "Service",
        "ConfigMap",
    } <= set(kinds)


def test_example_fits_the_crd_schema() -> None:
    (crd,) = _docs("crd.yaml")
    version = crd["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    job = _example()
    assert (job["apiVersion"], job["kind"]) == (
        f"{crd['spec']['group']}/{version['name']}",
        crd["spec"]["names"]["kind"],
    )
    assert set(schema["required"]) <= set(job["spec"])
    assert set(job["spec"]) <= set(schema["properties"])


def test_master_job_config_is_a_valid_job_spec() -> None:
    config = next(d for d in _docs("master-job.yaml") if d["kind"] == "ConfigMap")
    spec = job_spec_from_dict(yaml.safe_load(config["data"]["job.yaml"]))
    assert (spec.name, spec.engine, spec.min_nodes, spec.max_nodes) == ("mnist", "kubernetes", 2, 4)


def test_operator_builds_an_owned_master_with_the_token_in_a_secret() -> None:
    secret, config, claim, service, pod = master_objects(_example(), token="t0k")
    for obj in (secret, config, claim, service, pod):
        (owner,) = obj["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"]) == ("ElasticJob", "mnist", "uid-42")
        assert obj["metadata"]["namespace"] == "default"
    assert base64.b64decode(secret["data"]["token"]) == b"t0k"
    container = pod["spec"]["containers"][0]
    assert "t0k" not in str(pod)
    assert {
        "name": "DLROVER_JOB_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "mnist-token", "key": "token"}},
    } in container["env"]
    assert container["command"][0] == "dlrover-master"
    assert pod["spec"]["serviceAccountName"] == "dlrover-master"
    assert service["spec"]["selector"] == pod["metadata"]["labels"]
    # Its state lives on the claim: a restarted master container resumes the job from it.
    assert (
        claim["kind"] == "PersistentVolumeClaim"
        and claim["metadata"]["name"] == "mnist-master-state"
    )
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert pod["spec"]["restartPolicy"] == "OnFailure"
    (state_arg,) = [a for a in container["command"] if a.startswith("--state-db=")]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "master-state")
    assert state_arg == f"--state-db={mount['mountPath']}/master.db"
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "master-state")
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    # The spec the master reads back is the spec the ElasticJob describes.
    assert job_spec_from_dict(yaml.safe_load(config["data"]["job.yaml"])) == job_spec_of(_example())


def test_the_master_s_heartbeat_port_is_the_next_one_and_its_service_exposes_it() -> None:
    job = _example()
    job["spec"]["masterPort"] = 50001
    _, _, _, service, pod = master_objects(job, token="t0k")
    command = pod["spec"]["containers"][0]["command"]
    assert "--port=50001" in command and "--heartbeat-port=50002" in command
    assert {"name": "heartbeats", "port": 50002, "targetPort": 50002} in service["spec"]["ports"]
    assert {"name": "heartbeats", "containerPort": 50002} in pod["spec"]["containers"][0]["ports"]
    # The static master of deploy/kubernetes: every port its command names, its Service exposes.
    docs = _docs("master-job.yaml")
    static = next(d for d in docs if d["kind"] == "Service")["spec"]["ports"]
    (master,) = next(d for d in docs if d["kind"] == "Job")["spec"]["template"]["spec"][
        "containers"
    ]
    named = {
        int(a.split("=")[1])
        for a in master["command"]
        if a.startswith(("--port=", "--heartbeat-port="))
    }
    assert named == {p["targetPort"] for p in static} == {50001, 50002}


def test_invalid_elasticjob_is_one_clear_error() -> None:
    job = _example()
    job["spec"]["nodes"] = "4:2"
    with pytest.raises(JobSpecError, match="MIN \\(4\\) is greater than MAX \\(2\\)"):
        master_objects(job)


@pytest.mark.extras
@pytest.mark.skipif(importlib.util.find_spec("kopf") is None, reason="kopf is not installed")
def test_operator_handlers_import() -> None:
    from dlrover.operator import handlers

    assert callable(handlers.create_master)
