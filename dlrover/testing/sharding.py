"""A ShardingTransport that calls a ShardManager in this process: tests, benchmarks, examples."""

from __future__ import annotations

import threading
from typing import Any

from dlrover.api.rpc import Rpc, derive_client
from dlrover.api.sharding import ShardingTransport
from dlrover.api.wire import RPCS
from dlrover.sharding.manager import ShardManager

_ShardingCalls: Any = derive_client(
    "_ShardingCalls", {m: c for m, c in RPCS.items() if c.interface is ShardingTransport}
)
"""A method per ShardingTransport call, made from the interface (typed by it)."""


class InProcessTransport(_ShardingCalls, ShardingTransport):
    """Calls a ShardManager in this process under a lock: for tests, benchmarks, standalone.
    Each ShardingTransport method is the manager's method of the same name."""

    def __init__(self, manager: ShardManager) -> None:
        self.manager = manager
        self._lock = threading.Lock()

    def invoke(self, call: Rpc, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The manager's method of the call's name, under the lock."""
        with self._lock:
            return getattr(self.manager, call.method)(*args, **kwargs)

    # Master-side duties a test drives directly (the real master calls the manager itself).
    def recover_worker(self, worker_id: str) -> int:
        """Return every shard ``worker_id`` holds to its queue head, as the master does for a lost
        worker; returns how many."""
        with self._lock:
            return self.manager.recover_worker(worker_id)

    def tick(self, now: float | None = None) -> int:
        """Requeue the shards whose leases expired at ``now`` (default: the manager's clock), as the
        master's tick does; returns how many."""
        with self._lock:
            return self.manager.tick(now)
