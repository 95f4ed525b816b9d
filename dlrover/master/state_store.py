"""Durable key-value state of the master, so a restarted master resumes where it was."""

from __future__ import annotations

import json
import sqlite3
import threading
from abc import ABC, abstractmethod
from typing import Any


class StateStoreError(Exception):
    """The master's state could not be read or written."""


class StateStore(ABC):
    """Namespaced key -> bytes storage with compare-and-set.

    Invariant: a `put` that returned is durable for the store's lifetime (for the SQLite store,
    across process restarts); a failed write leaves the previous value intact.
    """

    @abstractmethod
    def get(self, namespace: str, key: str) -> bytes | None: ...

    @abstractmethod
    def put(self, namespace: str, key: str, value: bytes) -> None: ...

    @abstractmethod
    def delete(self, namespace: str, key: str) -> None: ...

    @abstractmethod
    def items(self, namespace: str) -> dict[str, bytes]: ...

    @abstractmethod
    def compare_and_set(
        self, namespace: str, key: str, expected: bytes | None, value: bytes
    ) -> bool:
        """Write `value` only if the current value equals `expected` (None: absent)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass

    def get_json(self, namespace: str, key: str) -> Any:
        raw = self.get(namespace, key)
        return None if raw is None else json.loads(raw)

    def put_json(self, namespace: str, key: str, value: Any) -> None:
        self.put(namespace, key, json.dumps(value, sort_keys=True).encode())


class MemoryStateStore(StateStore):
    """In-process store: state lives as long as the master process."""

    def __init__(self) -> None:
        self._data: dict[tuple[str, str], bytes] = {}
        self._lock = threading.Lock()

    def get(self, namespace: str, key: str) -> bytes | None:
        with self._lock:
            return self._data.get((namespace, key))

    def put(self, namespace: str, key: str, value: bytes) -> None:
        with self._lock:
            self._data[(namespace, key)] = bytes(value)

    def delete(self, namespace: str, key: str) -> None:
        with self._lock:
            self._data.pop((namespace, key), None)

    def items(self, namespace: str) -> dict[str, bytes]:
        with self._lock:
            return {k: v for (ns, k), v in self._data.items() if ns == namespace}

    def compare_and_set(
        self, namespace: str, key: str, expected: bytes | None, value: bytes
    ) -> bool:
        with self._lock:
            if self._data.get((namespace, key)) != expected:
                return False
            self._data[(namespace, key)] = bytes(value)
            return True


class SqliteStateStore(StateStore):
    """Embedded SQLite store (the default): one file, WAL journal, survives a master restart."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute(
                "CREATE TABLE IF NOT EXISTS state (namespace TEXT NOT NULL, key TEXT NOT NULL,"
                " value BLOB NOT NULL, PRIMARY KEY (namespace, key))"
            )
        except sqlite3.Error as e:
            raise StateStoreError(
                f"cannot open the master's state database {path!r}: {e}; "
                "pass a writable path with --state-db"
            ) from e
        self._lock = threading.Lock()

    def get(self, namespace: str, key: str) -> bytes | None:
        with self._lock:
            row = self._conn.execute(
                "SELECT value FROM state WHERE namespace=? AND key=?", (namespace, key)
            ).fetchone()
        return None if row is None else bytes(row[0])

    def put(self, namespace: str, key: str, value: bytes) -> None:
        with self._lock:
            self._conn.execute(
                "INSERT OR REPLACE INTO state (namespace, key, value) VALUES (?, ?, ?)",
                (namespace, key, sqlite3.Binary(value)),
            )

    def delete(self, namespace: str, key: str) -> None:
        with self._lock:
            self._conn.execute("DELETE FROM state WHERE namespace=? AND key=?", (namespace, key))

    def items(self, namespace: str) -> dict[str, bytes]:
        with self._lock:
            rows = self._conn.execute(
                "SELECT key, value FROM state WHERE namespace=?", (namespace,)
            ).fetchall()
        return {k: bytes(v) for k, v in rows}

    def compare_and_set(
        self, namespace: str, key: str, expected: bytes | None, value: bytes
    ) -> bool:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                row = self._conn.execute(
                    "SELECT value FROM state WHERE namespace=? AND key=?", (namespace, key)
                ).fetchone()
                current = None if row is None else bytes(row[0])
                if current != expected:
                    self._conn.execute("ROLLBACK")
                    return False
                self._conn.execute(
                    "INSERT OR REPLACE INTO state (namespace, key, value) VALUES (?, ?, ?)",
                    (namespace, key, sqlite3.Binary(value)),
                )
                self._conn.execute("COMMIT")
                return True
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def open_state_store(spec: str) -> StateStore:
    """`memory` (or empty) -> MemoryStateStore, anything else is a SQLite file path."""
    if spec in ("", "memory", ":memory:"):
        return MemoryStateStore()
    return SqliteStateStore(spec)
