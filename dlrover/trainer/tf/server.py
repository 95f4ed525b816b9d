"""A ps or worker task of a TensorFlow job: a `tf.distribute.Server` from TF_CONFIG that tells
the job's master once it serves and reports its usage, then serves until it is killed
(`dlrover-tf-node` runs it)."""

from __future__ import annotations

import json
import logging
import os
import sys

from dlrover import constants as c
from dlrover.coordination import TF_READY

logger = logging.getLogger("dlrover.tf_server")


def main() -> int:
    """Serve the task TF_CONFIG names; exit 2 when it names none."""
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(name)s: %(message)s")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        config = json.loads(os.environ["TF_CONFIG"])
        task = config["task"]
        role, index = str(task["type"]), int(task["index"])
    except (KeyError, ValueError, TypeError) as e:
        print(f"dlrover.trainer.tf.server: TF_CONFIG names no task: {e!r}", file=sys.stderr)
        return 2
    import tensorflow as tf

    server = tf.distribute.Server(
        tf.train.ClusterSpec(config["cluster"]),
        job_name=role,
        task_index=index,
        protocol="grpc",
        start=True,
    )
    logger.info("%s %d serves at %s", role, index, server.target)
    node = os.environ.get(c.ENV_NODE_NAME, "")
    master = os.environ.get(c.ENV_MASTER_ADDR, "")
    if master and node:
        from dlrover.client.master_client import MasterClient
        from dlrover.trainer.tf.usage import UsageReporter

        client = MasterClient(master, os.environ.get(c.ENV_JOB_TOKEN, ""))
        TF_READY.put(client, server.target, node)
        # The master sizes and watches the ps from these (memory before an OOM kill, hot ps).
        reporter = UsageReporter.from_env(client, lambda: [os.getpid()])
        if reporter is not None:
            reporter.start()
    server.join()  # until the engine stops the node (SIGTERM) or it is killed
    return 0


if __name__ == "__main__":
    sys.exit(main())
