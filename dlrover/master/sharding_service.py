"""The master's side of dynamic data sharding: JSON calls onto one ShardManager, persisted."""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from dlrover.master.state_store import StateStore
from dlrover.sharding.manager import ShardManager
from dlrover.sharding.types import ConsumptionMark, DatasetSpec, Position, ShardId

logger = logging.getLogger(__name__)

_NAMESPACE = "sharding"
MUTATING = frozenset(
    {"register_dataset", "fetch_shards", "report_done", "report_progress", "restore_position"}
)


class ShardingService:
    """Serialises calls onto the ShardManager and saves its state after every change.

    The state is a few kilobytes (index ranges, not samples), so it is written whole; a
    restarted master rebuilds the manager from it and no registered dataset is reset.
    """

    def __init__(self, store: StateStore, clock: Callable[[], float]) -> None:
        self._store = store
        self._lock = threading.Lock()
        saved = store.get_json(_NAMESPACE, "state")
        self.manager = ShardManager.from_state(saved, clock) if saved else ShardManager(clock)
        self._methods: dict[str, Callable[[dict[str, Any]], Any]] = {
            "register_dataset": lambda a: self.manager.register_dataset(
                DatasetSpec.from_dict(a["spec"])
            ),
            "fetch_shards": lambda a: self.manager.fetch_shards(
                str(a["dataset"]), str(a["worker_id"]), int(a.get("max_count", 1))
            ),
            "report_done": lambda a: self.manager.report_done(
                str(a["dataset"]),
                str(a["worker_id"]),
                [ShardId.from_list(x) for x in a["shard_ids"]],
            ),
            "report_progress": lambda a: self.manager.report_progress(
                str(a["dataset"]),
                str(a["worker_id"]),
                ShardId.from_list(a["shard_id"]),
                int(a["consumed"]),
            ),
            "renew_leases": lambda a: self.manager.renew_leases(
                str(a["dataset"]), str(a["worker_id"])
            ),
            "get_position": lambda a: self.manager.get_position(str(a["dataset"])),
            # Marks live in memory only (one per shard a worker starts): not persisted.
            "mark_consumption": lambda a: self.manager.mark_consumption(
                str(a["dataset"]), str(a["worker_id"]), ConsumptionMark.from_dict(a["mark"])
            ),
            "position_at": lambda a: self.manager.position_at(
                str(a["dataset"]), int(a["epoch"]), int(a["consumed"])
            ),
            "restore_position": lambda a: self.manager.restore_position(
                Position.from_dict(a["position"]), a.get("token")
            ),
            "dataset_progress": lambda a: self.manager.dataset_progress(str(a["dataset"])),
        }

    def call(self, method: str, args_json: bytes) -> bytes:
        """Run one call; raises ValueError for an unknown method or malformed arguments."""
        fn = self._methods.get(method)
        if fn is None:
            raise ValueError(f"unknown sharding method {method!r}; known: {sorted(self._methods)}")
        try:
            args = json.loads(args_json or b"{}")
        except json.JSONDecodeError as e:
            raise ValueError(f"sharding call {method}: arguments are not JSON ({e})") from None
        if not isinstance(args, dict):
            raise ValueError(f"sharding call {method}: arguments must be a JSON object")
        with self._lock:
            try:
                result = fn(args)
            except (KeyError, TypeError) as e:
                if type(e).__module__.startswith("dlrover"):
                    raise
                raise ValueError(f"sharding call {method}: malformed arguments ({e})") from None
            if method in MUTATING:
                self._save()
        return json.dumps(_to_json(result)).encode()

    def recover_node(self, node_id: str) -> int:
        """A node's workers are gone: their shards go back to the head of their queues."""
        with self._lock:
            count = self.manager.recover_node(node_id)
            if count:
                self._save()
            return count

    def tick(self) -> None:
        with self._lock:
            if self.manager.tick():
                self._save()

    def _save(self) -> None:
        self._store.put_json(_NAMESPACE, "state", self.manager.to_state())


def _to_json(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value
