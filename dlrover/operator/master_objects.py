"""Builds the objects the operator creates for an ElasticJob: token Secret, spec ConfigMap,
master Service and master pod (plain dicts, no Kubernetes client needed)."""

from __future__ import annotations

import base64
import secrets
from typing import Any

import yaml

from dlrover.constants import ENV_JOB_TOKEN
from dlrover.elasticjob import KUBE_KEYS, ElasticJobError, tensorflow_keys
from dlrover.engines.base import Resources
from dlrover.engines.kube_manifests import (
    DEFAULT_MASTER_PORT,
    OwnerReference,
    job_labels,
    master_address,
    master_pod_manifest,
    master_service_manifest,
)
from dlrover.engines.registry import KUBERNETES
from dlrover.jobspec import JobSpec, JobSpecError, job_spec_from_dict

GROUP = "dlrover.io"
VERSION = "v1alpha1"
KIND = "ElasticJob"
PLURAL = "elasticjobs"
SPEC_MOUNT_DIR = "/etc/dlrover"
STATE_MOUNT_DIR = "/var/lib/dlrover"
"""Where the master pod mounts its state claim (the SQLite state survives the container)."""
SPEC_FILE = "job.yaml"


def owner_of(body: dict[str, Any]) -> OwnerReference:
    """The ElasticJob in ``body`` as the owner of the objects made for it (deleting it deletes
    them)."""
    meta = body["metadata"]
    return OwnerReference(f"{GROUP}/{VERSION}", KIND, meta["name"], meta["uid"])


def job_spec_of(body: dict[str, Any]) -> JobSpec:
    """The JobSpec an ElasticJob describes (its name is the resource's name; engine kubernetes).
    Raises JobSpecError with one clear message for a bad resource."""
    spec = {k: v for k, v in dict(body.get("spec") or {}).items() if k not in KUBE_KEYS}
    try:
        tensorflow_keys(spec)
    except ElasticJobError as error:
        raise JobSpecError(str(error)) from None
    settings = dict(spec.pop("engine_settings", None) or {})
    kube = body.get("spec") or {}
    settings.update(
        namespace=body["metadata"].get("namespace", "default"),
        image=kube.get("image", ""),
        service_account=kube.get("serviceAccount", ""),
    )
    return job_spec_from_dict(
        {
            **spec,
            "name": body["metadata"]["name"],
            "engine": KUBERNETES.name,
            "engine_settings": settings,
        }
    )


def _resources(resources: Resources) -> dict[str, Any]:
    return {
        "cpu": resources.cpu,
        "memory": f"{resources.memory_mib}Mi",
        "gpu": resources.gpu,
        "shm": f"{resources.shm_mib}Mi",
    }


def spec_document(job: JobSpec) -> dict[str, Any]:
    """The job spec as the YAML the master reads back (`dlrover-master --job-spec`)."""
    document: dict[str, Any] = {
        "name": job.name,
        "entrypoint": job.entrypoint,
        "args": list(job.args),
        "resources": _resources(job.resources),
        "max_restarts": job.max_restarts,
        "max_relaunches": job.max_relaunches,
        "checkpoint_dir": job.checkpoint_dir,
        "engine": KUBERNETES.name,
        "engine_settings": dict(job.engine_settings),
    }
    if job.tf is not None:
        document["distribution_strategy"] = job.tf.strategy
        document["roles"] = {
            role: {"count": spec.count, "resources": _resources(spec.resources)}
            for role, spec in job.tf.roles.items()
        }
    else:
        document.update(nodes=job.nnodes, nproc_per_node=job.nproc_per_node)
    if job.ps is not None:
        document["roles"] = {
            "ps": {
                "count": job.ps.count,
                "resources": _resources(job.ps.resources),
                "replica": job.ps.replica,
            }
        }
    return document


def master_objects(body: dict[str, Any], token: str | None = None) -> list[dict[str, Any]]:
    """Every object that makes up the master of this ElasticJob, each owned by it."""
    job = job_spec_of(body)
    meta = body["metadata"]
    namespace = meta.get("namespace", "default")
    kube = body.get("spec") or {}
    port = int(kube.get("masterPort", DEFAULT_MASTER_PORT))
    owner = owner_of(body)
    token = token or secrets.token_urlsafe(32)
    labels = job_labels(job.name)
    secret_name = f"{job.name}-token"
    config_name = f"{job.name}-spec"
    job_yaml = yaml.safe_dump(spec_document(job), sort_keys=True)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": secret_name,
            "namespace": namespace,
            "labels": labels,
            "ownerReferences": [owner.manifest()],
        },
        "data": {"token": base64.b64encode(token.encode()).decode()},
    }
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": config_name,
            "namespace": namespace,
            "labels": labels,
            "ownerReferences": [owner.manifest()],
        },
        "data": {SPEC_FILE: job_yaml},
    }
    state_claim: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": f"{job.name}-master-state",
            "namespace": namespace,
            "labels": labels,
            "ownerReferences": [owner.manifest()],
        },
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "resources": {"requests": {"storage": str(kube.get("masterStateSize") or "1Gi")}},
        },
    }
    if kube.get("masterStorageClass"):
        state_claim["spec"]["storageClassName"] = str(kube["masterStorageClass"])
    # Heartbeats have a server of their own on the next port, which the Service exposes too.
    heartbeat_port = port + 1 if 0 < port < 65535 else 0
    command = [
        "dlrover-master",
        f"--job-spec={SPEC_MOUNT_DIR}/{SPEC_FILE}",
        # On the claim: a master container restarted (crash, OOM, eviction of the process)
        # resumes the job from it; the pod's restartPolicy is OnFailure.
        f"--state-db={STATE_MOUNT_DIR}/master.db",
        f"--port={port}",
        f"--heartbeat-port={heartbeat_port or -1}",
        f"--advertise-address={master_address(job.name, namespace, port)}",
    ]
    pod = master_pod_manifest(
        job.name,
        namespace,
        kube.get("masterImage") or kube["image"],
        command,
        {},
        port=port,
        owner=owner,
        service_account=kube.get("serviceAccount") or "dlrover-master",
        heartbeat_port=heartbeat_port,
    )
    container = pod["spec"]["containers"][0]
    # The token never sits in the pod spec: it comes from the Secret.
    container["env"].append(
        {
            "name": ENV_JOB_TOKEN,
            "valueFrom": {"secretKeyRef": {"name": secret_name, "key": "token"}},
        }
    )
    container["volumeMounts"] = [
        {"name": "job-spec", "mountPath": SPEC_MOUNT_DIR, "readOnly": True},
        {"name": "master-state", "mountPath": STATE_MOUNT_DIR},
    ]
    pod["spec"]["volumes"] = [
        {"name": "job-spec", "configMap": {"name": config_name}},
        {
            "name": "master-state",
            "persistentVolumeClaim": {"claimName": f"{job.name}-master-state"},
        },
    ]
    service = master_service_manifest(job.name, namespace, port, owner, heartbeat_port)
    return [secret, config, state_claim, service, pod]
