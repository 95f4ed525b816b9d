"""A small key-value store on the master that agents and workers publish values through."""

from __future__ import annotations

import threading

from dlrover.constants import MAX_KV_VALUE_BYTES
from dlrover.master.state_store import StateStore

_NAMESPACE = "kv"
MAX_KV_WAIT_S = 30.0
MAX_KEYS = 100_000


class KvError(Exception):
    """A key-value request that is refused (value too large, too many keys)."""


class KvStore:
    """Keys -> bytes, persisted in the StateStore; readers may wait (bounded) for a key."""

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._cond = threading.Condition()
        self._data: dict[str, bytes] = dict(store.items(_NAMESPACE))
        self._waiting: dict[str, int] = {}
        self._closed = False

    def close(self) -> None:
        """The master stops: waiting readers return now (a blocked reader would hold the exiting
        process for up to MAX_KV_WAIT_S)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (persisted) and wake its readers. Raises KvError for an
        empty key, a value over MAX_KV_VALUE_BYTES, or a new key beyond MAX_KEYS."""
        if not key:
            raise KvError("empty key")
        if len(value) > MAX_KV_VALUE_BYTES:
            raise KvError(
                f"value of {key!r} is {len(value)} bytes; the limit is {MAX_KV_VALUE_BYTES}"
            )
        with self._cond:
            if key not in self._data and len(self._data) >= MAX_KEYS:
                raise KvError(f"the key-value store is full ({MAX_KEYS} keys)")
            self._store.put(_NAMESPACE, key, value)
            self._data[key] = value
            self._cond.notify_all()

    def get(self, key: str, wait_s: float = 0.0) -> bytes | None:
        """The value, waiting up to min(wait_s, MAX_KV_WAIT_S) for it to appear."""
        with self._cond:
            if key not in self._data and wait_s > 0 and not self._closed:
                self._waiting[key] = self._waiting.get(key, 0) + 1
                self._cond.notify_all()
                try:
                    self._cond.wait_for(
                        lambda: key in self._data or self._closed,
                        timeout=min(wait_s, MAX_KV_WAIT_S),
                    )
                finally:
                    self._waiting[key] -= 1
                    if not self._waiting[key]:
                        del self._waiting[key]
            return self._data.get(key)

    # The master serves `dlrover.api.master.KvApi` with these.
    kv_set = set
    kv_get = get

    def wait_for_readers(self, key: str, count: int, timeout: float) -> bool:
        """Whether `count` readers are blocked waiting for `key` within `timeout` seconds."""
        with self._cond:
            return self._cond.wait_for(lambda: self._waiting.get(key, 0) >= count, timeout)
