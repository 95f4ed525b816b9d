"""A TensorFlow node's usage reports: its CPU and memory, measured by the node, to the master."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import psutil

from dlrover import constants as c
from dlrover.api.errors import MasterClientError
from dlrover.client.master_client import MasterClient
from dlrover.coordination import TF_USAGE, TfNodeUsage
from dlrover.envvars import number_from_env
from dlrover.processes import UsageMeter

logger = logging.getLogger(__name__)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants now (a chief's program may start processes of its own)."""
    try:
        return [pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return [pid]


class UsageReporter:
    """Sets the node's `TfNodeUsage` under `TF_USAGE_KEY` + ``node_id`` every ``interval_s``
    from a daemon thread until `stop`. A master that does not answer (it is being restarted)
    only skips reports: the node's work never waits on them."""

    def __init__(
        self,
        client: MasterClient,
        node_id: str,
        pids: Callable[[], list[int]],
        interval_s: float,
    ) -> None:
        self._client = client
        self._node = node_id
        self._pids = pids
        self._interval_s = interval_s
        self._meter = UsageMeter()
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="dlrover-tf-usage")

    @classmethod
    def from_env(cls, client: MasterClient, pids: Callable[[], list[int]]) -> UsageReporter | None:
        """The reporter of the node the master launched (its node id and interval from the
        environment), or None where the node has no id or reports are off (interval 0)."""
        node = os.environ.get(c.ENV_NODE_NAME, "")
        interval = number_from_env(
            c.ENV_TF_USAGE_INTERVAL_S, c.DEFAULT_TF_USAGE_INTERVAL_S, "a number of seconds"
        )
        if not node or interval <= 0:
            return None
        return cls(client, node, pids, interval)

    def start(self) -> UsageReporter:
        """Measure once now (psutil's CPU needs a first sample) and report from then on."""
        self._meter.sample(self._pids())
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop reporting (waits up to ``timeout_s`` for a report in flight)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def report(self) -> TfNodeUsage:
        """Measure and send one report; returns it."""
        cpu, memory = self._meter.sample(self._pids())
        self._peak = max(self._peak, memory)
        usage = TfNodeUsage(cpu, memory, self._peak, os.getpid(), time.time())
        TF_USAGE.put(self._client, usage, self._node)
        return usage

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self.report()
            except MasterClientError as e:
                logger.debug("usage report skipped: %s", e)
