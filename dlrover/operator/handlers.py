"""kopf handlers: on ElasticJob create, create its master objects (run: kopf run -m ...)."""

from __future__ import annotations

import logging
from typing import Any

import kopf
from kubernetes import client, config

from dlrover.jobspec import JobSpecError
from dlrover.operator.master_objects import GROUP, PLURAL, VERSION, master_objects

_CREATORS = {
    "Secret": "create_namespaced_secret",
    "ConfigMap": "create_namespaced_config_map",
    "Service": "create_namespaced_service",
    "PersistentVolumeClaim": "create_namespaced_persistent_volume_claim",
    "Pod": "create_namespaced_pod",
}


@kopf.on.startup()
def _configure(logger: logging.Logger | logging.LoggerAdapter[Any], **_: Any) -> None:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


@kopf.on.create(GROUP, VERSION, PLURAL)
def create_master(
    body: kopf.Body,
    namespace: str | None,
    logger: logging.Logger | logging.LoggerAdapter[Any],
    **_: Any,
) -> dict[str, str]:
    """Create the master of a new ElasticJob; idempotent (409 = created by an earlier try)."""
    try:
        objects = master_objects(dict(body))
    except (JobSpecError, KeyError) as error:
        # A bad resource will not get better by retrying: report it on the object and stop.
        raise kopf.PermanentError(f"invalid ElasticJob: {error}") from error
    core = client.CoreV1Api()
    for obj in objects:
        try:
            getattr(core, _CREATORS[obj["kind"]])(obj["metadata"]["namespace"], obj)
            logger.info("created %s %s", obj["kind"], obj["metadata"]["name"])
        except client.ApiException as error:
            if error.status != 409:
                raise kopf.TemporaryError(
                    f"creating {obj['kind']}: {error.reason}", delay=10
                ) from error
    return {"master": objects[-1]["metadata"]["name"]}
