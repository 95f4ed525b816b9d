"""Adding workers to a running chief's ParameterServerStrategy without starting it again.

TensorFlow's coordinator fixes its workers when it is made, and a process cannot join a second
cluster, so a chief used to exec itself to train on more workers (a checkpoint, TensorFlow's
import, a build and a restore: seconds of no training). The eager context can however update
its cluster in place (``update_server_def``, what the coordinator itself does when a worker
comes back), and the coordinator's cluster takes one more worker thread. Both are private
interfaces of TensorFlow (checked on 2.21), so every step is guarded: where one is missing or
fails, the caller starts again on the new cluster as before.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def workers_added(old: dict[str, list[str]], new: dict[str, list[str]]) -> list[str]:
    """The workers ``new`` adds to ``old`` when that is its only change (every other role the
    same, the old workers its first ones, in order); else []."""
    old_workers, new_workers = old.get("worker", []), new.get("worker", [])
    others_same = all(
        old.get(role, []) == new.get(role, []) for role in set(old) | set(new) if role != "worker"
    )
    if not others_same or new_workers[: len(old_workers)] != old_workers:
        return []
    return new_workers[len(old_workers) :]


def grow_workers(strategy: Any, coordinator: Any, cluster: dict[str, list[str]]) -> bool:
    """Have ``coordinator`` (of ``strategy``, with nothing scheduled) run closures on the
    workers ``cluster`` adds to the one it was made for; every new worker must serve already.
    Returns False, having changed nothing the caller relies on, where TensorFlow offers no way:
    the caller then starts again on ``cluster``."""
    try:
        import tensorflow as tf
        from tensorflow.python.distribute.coordinator import cluster_coordinator
        from tensorflow.python.eager import context
    except ImportError as e:  # pragma: no cover - TensorFlow moved its internals
        logger.info("workers cannot be added in place (%s): starting again", e)
        return False
    tf_cluster = getattr(coordinator, "_cluster", None)
    workers = getattr(tf_cluster, "workers", None)
    handler = getattr(tf_cluster, "failure_handler", None)
    if tf_cluster is None or not isinstance(workers, list) or handler is None:
        logger.info("this TensorFlow's coordinator cannot take more workers: starting again")
        return False
    count = len(cluster.get("worker", []))
    if count <= len(workers):
        return False
    server_def = context.get_server_def()
    server_def.cluster.CopyFrom(tf.train.ClusterSpec(cluster).as_cluster_def())
    try:
        context.context().update_server_def(server_def)
    except Exception as e:  # noqa: BLE001 - TensorFlow raises many kinds; every one means "no"
        logger.warning("could not add the workers in place (%s): starting again", e)
        return False
    # The coordinator's recovery from a lost worker updates the cluster again: with this one.
    if hasattr(handler, "_server_def"):
        handler._server_def = server_def
    for index in range(len(workers), count):
        device = f"/job:worker/replica:0/task:{index}"
        workers.append(cluster_coordinator.Worker(index, device, tf_cluster))
    # The counts the strategy and the coordinator keep (for per-worker resources, the
    # transient-timeout budget): the new ones.
    for owner in (tf_cluster, strategy, getattr(strategy, "extended", None)):
        if owner is not None and hasattr(owner, "_num_workers"):
            owner._num_workers = count
    return True
