"""The ElasticJob resource's spelling of a job (the seeds' and the operator's) as a job spec."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

KIND = "ElasticJob"
API_VERSIONS = ("dlrover.io/v1alpha1", "elastic.iml.github.io/v1alpha1")
"""The operator's group, and the seeds' (whose ElasticJob YAMLs `dlrover submit` runs too)."""
KUBE_KEYS = ("image", "masterImage", "serviceAccount", "masterPort")
"""Keys of an ElasticJob's spec that configure Kubernetes rather than the job itself."""
OPTIMIZE_MODE = "optimizeMode"
"""The seeds' ElasticJob key that turns their optimiser on (``single-job``): here it means
``auto_scale: true`` (the master sizes the roles given without resources)."""
_PYTHONS = ("python", "python3")


class ElasticJobError(ValueError):
    """An ElasticJob that cannot be read as a job spec (the message says what to change)."""


def is_elasticjob(raw: Any) -> bool:
    """Whether ``raw`` (a parsed YAML document) is an ElasticJob resource."""
    return isinstance(raw, Mapping) and raw.get("kind") == KIND


def cpu(value: Any) -> Any:
    """Kubernetes' ``500m`` as 0.5; numbers and other text as they are (the job spec checks)."""
    if isinstance(value, str) and value.endswith("m") and value[:-1].isdigit():
        return int(value[:-1]) / 1000
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _container(replica: Mapping[str, Any]) -> Mapping[str, Any]:
    """A replica's pod template's first container ({} for none)."""
    containers = ((replica.get("template") or {}).get("spec") or {}).get("containers") or []
    return containers[0] if containers and isinstance(containers[0], Mapping) else {}


def replica_resources(replica: Mapping[str, Any]) -> dict[str, Any] | None:
    """A replica spec's resources: its own ``resources`` ({cpu, memory, gpu}), else the limits
    (or requests) of its pod template's first container, as the seeds' ElasticJob wrote them;
    None for none (the master sizes the role)."""
    if "resources" in replica:
        return dict(replica["resources"])
    wanted = _container(replica).get("resources") or {}
    found = dict(wanted.get("limits") or wanted.get("requests") or {})
    resources: dict[str, Any] = {}
    if "cpu" in found:
        resources["cpu"] = cpu(found["cpu"])
    if "memory" in found:
        resources["memory"] = found["memory"]
    if "nvidia.com/gpu" in found:
        resources["gpu"] = int(found["nvidia.com/gpu"])
    return resources or None


def _program(replicas: Mapping[str, Any]) -> tuple[str, list[str]] | None:
    """(entrypoint, args) from the container command (and args) of the chief's replica, else
    the worker's: the program the chief runs. ``python script.py ARGS`` is the script."""
    for role in ("chief", "worker"):
        replica = replicas.get(role)
        if not isinstance(replica, Mapping):
            continue
        container = _container(replica)
        command = [str(part) for part in container.get("command") or []]
        command += [str(part) for part in container.get("args") or []]
        if not command:
            continue
        python = len(command) > 1 and os.path.basename(command[0]) in _PYTHONS
        if python and command[1].endswith(".py"):
            return command[1], command[2:]
        return command[0], command[1:]
    return None


def tensorflow_keys(spec: dict[str, Any]) -> None:
    """The ElasticJob's spelling of a TensorFlow job (``distributionStrategy``, ``replicaSpecs:
    {ps: {replicas: 2, template: ...}}``) as the job spec's (``distribution_strategy``,
    ``roles: {ps: {count: 2, resources}}``), in place. A replica without ``replicas`` is one
    node, without resources is sized by the master; the entrypoint, when the spec names none,
    is the chief's (else the worker's) container command."""
    if "distributionStrategy" in spec:
        spec["distribution_strategy"] = spec.pop("distributionStrategy")
    if spec.pop(OPTIMIZE_MODE, None):
        spec["auto_scale"] = True
    replicas = spec.pop("replicaSpecs", None)
    if replicas is None:
        return
    if not isinstance(replicas, dict):
        raise ElasticJobError("replicaSpecs must map each role to {replicas, template|resources}")
    roles: dict[str, Any] = {}
    for role, replica in replicas.items():
        if not isinstance(replica, dict):
            raise ElasticJobError(f"replicaSpecs.{role} must be a mapping: replicas, template")
        roles[role] = {"count": replica.get("replicas", 1)}
        resources = replica_resources(replica)
        if resources:
            roles[role]["resources"] = resources
    spec["roles"] = roles
    if not spec.get("entrypoint"):
        program = _program(replicas)
        if program is None:
            raise ElasticJobError(
                "no entrypoint: give spec.entrypoint, or a command in the chief's (or the "
                "worker's) container: replicaSpecs.worker.template.spec.containers[0].command"
            )
        spec["entrypoint"], args = program
        spec["args"] = [*args, *(spec.get("args") or [])]


def spec_of(body: Mapping[str, Any]) -> dict[str, Any]:
    """The job spec mapping an ElasticJob describes, for `dlrover submit FILE` on any engine:
    its name is the resource's name; the Kubernetes keys (image, service account) are left out.
    Raises ElasticJobError for what cannot be read."""
    version = body.get("apiVersion", "")
    if version not in API_VERSIONS:
        raise ElasticJobError(
            f"apiVersion {version!r} of kind {KIND} is not known; use {' or '.join(API_VERSIONS)}"
        )
    name = (body.get("metadata") or {}).get("name")
    if not name:
        raise ElasticJobError("metadata.name is missing: the job's name")
    spec = {k: v for k, v in dict(body.get("spec") or {}).items() if k not in KUBE_KEYS}
    tensorflow_keys(spec)
    return {**spec, "name": name}
