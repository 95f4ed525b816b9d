"""Kubernetes object manifests (plain dicts) for a job's node pods and its master Service/pod."""

from __future__ import annotations

import dataclasses
from typing import Any

from dlrover.constants import ENV_RANK_LOG_DIR, ENV_RANK_LOG_ECHO
from dlrover.engines.base import NodeSpec, Resources
from dlrover.engines.kube_logs import RANK_LOG_DIR_IN_POD

LABEL_APP = "app.kubernetes.io/name"
LABEL_JOB = "dlrover.io/job"
LABEL_ROLE = "dlrover.io/role"
LABEL_RANK = "dlrover.io/rank"
LABEL_RELAUNCH_COUNT = "dlrover.io/relaunch-count"
APP_NAME = "dlrover"
MASTER_ROLE = "master"
DEFAULT_MASTER_PORT = 50001
"""Port of the master's gRPC service inside the cluster."""
SHM_VOLUME = "dshm"
GPU_RESOURCE = "nvidia.com/gpu"


@dataclasses.dataclass(frozen=True)
class OwnerReference:
    """The object whose deletion garbage-collects the job's pods (the ElasticJob or master)."""

    api_version: str
    kind: str
    name: str
    uid: str

    def manifest(self) -> dict[str, Any]:
        """The ``ownerReferences`` entry pointing at this owner, as its controller."""
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


@dataclasses.dataclass(frozen=True)
class PodSettings:
    """How node pods are built: image and cluster placement, shared by every node of a job."""

    image: str
    """Container image holding dlrover and the training code."""
    namespace: str = "default"
    owner: OwnerReference | None = None
    service_account: str = ""
    image_pull_policy: str = "IfNotPresent"
    node_selector: dict[str, str] = dataclasses.field(default_factory=dict)


def job_labels(job_name: str) -> dict[str, str]:
    """The labels every object of the job carries: the app name and the job name."""
    return {LABEL_APP: APP_NAME, LABEL_JOB: job_name}


def job_selector(job_name: str, role: str | None = None) -> str:
    """Label selector of a job's pods (optionally one role)."""
    selector = f"{LABEL_APP}={APP_NAME},{LABEL_JOB}={job_name}"
    return f"{selector},{LABEL_ROLE}={role}" if role else selector


def _quantity_cpu(cpu: float) -> str:
    return str(int(cpu)) if cpu == int(cpu) else f"{int(round(cpu * 1000))}m"


def shm_size_mib(spec: NodeSpec) -> int:
    """/dev/shm size: explicit, else half the memory limit (flash checkpoint holds one copy of
    the state in it), else 0 = unbounded by the volume (bounded by the pod's memory limit)."""
    if spec.resources.shm_mib:
        return spec.resources.shm_mib
    return spec.resources.memory_mib // 2


def container_resources(resources: Resources) -> dict[str, dict[str, str]]:
    """A node container's ``requests`` and ``limits``: CPU requested, memory requested = limit,
    GPUs both."""
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    if resources.cpu:
        requests["cpu"] = _quantity_cpu(resources.cpu)
    if resources.memory_mib:
        requests["memory"] = limits["memory"] = f"{resources.memory_mib}Mi"
    if resources.gpu:
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(resources.gpu)
    return {"requests": requests, "limits": limits}


def pod_manifest(spec: NodeSpec, settings: PodSettings) -> dict[str, Any]:
    """The pod that runs one node: its agent command, env, resources and a memory /dev/shm."""
    shm: dict[str, Any] = {"medium": "Memory"}
    if shm_size_mib(spec):
        shm["sizeLimit"] = f"{shm_size_mib(spec)}Mi"
    labels = {
        **job_labels(spec.job_name),
        LABEL_ROLE: spec.role,
        LABEL_RANK: str(spec.rank),
        LABEL_RELAUNCH_COUNT: str(spec.relaunch_count),
    }
    metadata: dict[str, Any] = {
        "name": spec.node_id,
        "namespace": settings.namespace,
        "labels": labels,
    }
    if settings.owner is not None:
        metadata["ownerReferences"] = [settings.owner.manifest()]
    container: dict[str, Any] = {
        "name": spec.role,
        "image": settings.image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": list(spec.command),
        "env": [{"name": k, "value": v} for k, v in sorted(_node_env(spec).items())],
        "resources": container_resources(spec.resources),
        "volumeMounts": [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}],
    }
    pod_spec: dict[str, Any] = {
        # The agent restarts workers in place; replacing a pod is the master's decision.
        "restartPolicy": "Never",
        "containers": [container],
        "volumes": [{"name": SHM_VOLUME, "emptyDir": shm}],
    }
    if settings.service_account:
        pod_spec["serviceAccountName"] = settings.service_account
    if settings.node_selector:
        pod_spec["nodeSelector"] = dict(settings.node_selector)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def master_service_manifest(
    job_name: str,
    namespace: str,
    port: int = DEFAULT_MASTER_PORT,
    owner: OwnerReference | None = None,
    heartbeat_port: int = 0,
) -> dict[str, Any]:
    """The Service agents dial: `<job>-master.<namespace>:<port>` -> the master pod, and its
    heartbeat port where it has one (`dlrover-master --heartbeat-port`; 0: none)."""
    metadata: dict[str, Any] = {
        "name": f"{job_name}-master",
        "namespace": namespace,
        "labels": {**job_labels(job_name), LABEL_ROLE: MASTER_ROLE},
    }
    if owner is not None:
        metadata["ownerReferences"] = [owner.manifest()]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata,
        "spec": {
            "selector": {**job_labels(job_name), LABEL_ROLE: MASTER_ROLE},
            "ports": [{"name": "grpc", "port": port, "targetPort": port}]
            + (
                [{"name": "heartbeats", "port": heartbeat_port, "targetPort": heartbeat_port}]
                if heartbeat_port
                else []
            ),
        },
    }


def master_address(job_name: str, namespace: str, port: int = DEFAULT_MASTER_PORT) -> str:
    """The in-cluster address of the job's master Service:
    ``<job>-master.<namespace>.svc:<port>``."""
    return f"{job_name}-master.{namespace}.svc:{port}"


def master_pod_manifest(
    job_name: str,
    namespace: str,
    image: str,
    command: list[str],
    env: dict[str, str],
    port: int = DEFAULT_MASTER_PORT,
    service_account: str = "dlrover-master",
    owner: OwnerReference | None = None,
    heartbeat_port: int = 0,
) -> dict[str, Any]:
    """The pod that runs a job's master (`dlrover-master ...`), selected by its Service."""
    metadata: dict[str, Any] = {
        "name": f"{job_name}-master",
        "namespace": namespace,
        "labels": {**job_labels(job_name), LABEL_ROLE: MASTER_ROLE},
    }
    if owner is not None:
        metadata["ownerReferences"] = [owner.manifest()]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            # A crashed master restarts in place and resumes from its StateStore.
            "restartPolicy": "OnFailure",
            "serviceAccountName": service_account,
            "containers": [
                {
                    "name": MASTER_ROLE,
                    "image": image,
                    "command": command,
                    "env": [{"name": k, "value": v} for k, v in sorted(env.items())],
                    "ports": [{"name": "grpc", "containerPort": port}]
                    + (
                        [{"name": "heartbeats", "containerPort": heartbeat_port}]
                        if heartbeat_port
                        else []
                    ),
                }
            ],
        },
    }


def _node_env(spec: NodeSpec) -> dict[str, str]:
    """The spec's environment, plus where the agent keeps per-rank logs and that it echoes them
    to the pod's log (what `dlrover logs` reads through the API)."""
    return {ENV_RANK_LOG_DIR: RANK_LOG_DIR_IN_POD, ENV_RANK_LOG_ECHO: "1", **spec.env}
