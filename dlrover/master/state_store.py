"""Durable key-value state of the master, so a restarted master resumes where it was."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Collection

from dlrover.master.redis_store import RedisStateStore
from dlrover.master.store_base import StateMismatchError, StateStore, StateStoreError

__all__ = [
    "MemoryStateStore",
    "SqliteStateStore",
    "StateMismatchError",
    "StateStore",
    "StateStoreError",
    "open_state_store",
]


class MemoryStateStore(StateStore):
    """In-process store: state lives as long as the master process."""

    def __str__(self) -> str:
        return "memory"

    def __init__(self) -> None:
        self._data: dict[tuple[str, str], bytes] = {}
        self._lock = threading.Lock()

    def get(self, namespace: str, key: str) -> bytes | None:
        """The value of ``key`` in ``namespace``, or None if absent."""
        with self._lock:
            return self._data.get((namespace, key))

    def put(self, namespace: str, key: str, value: bytes) -> None:
        """Store a copy of ``value``."""
        with self._lock:
            self._data[(namespace, key)] = bytes(value)

    def delete(self, namespace: str, key: str) -> None:
        """Remove ``key`` from ``namespace`` if present."""
        with self._lock:
            self._data.pop((namespace, key), None)

    def put_many(
        self, namespace: str, values: dict[str, bytes], delete: Collection[str] = ()
    ) -> None:
        """Remove the keys of ``delete`` and write ``values``, under the store's lock."""
        with self._lock:
            for key in delete:
                self._data.pop((namespace, key), None)
            for key, value in values.items():
                self._data[(namespace, key)] = bytes(value)

    def items(self, namespace: str) -> dict[str, bytes]:
        """A copy of ``namespace``'s keys and values."""
        with self._lock:
            return {k: v for (ns, k), v in self._data.items() if ns == namespace}

    def compare_and_set(
        self, namespace: str, key: str, expected: bytes | None, value: bytes
    ) -> bool:
        """Write ``value`` only if the current value equals ``expected`` (None: absent); atomic
        under the store's lock."""
        with self._lock:
            if self._data.get((namespace, key)) != expected:
                return False
            self._data[(namespace, key)] = bytes(value)
            return True


class SqliteStateStore(StateStore):
    """Embedded SQLite store (the default): one file, WAL journal, survives a master restart."""

    def __str__(self) -> str:
        return self.path

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
            self._conn.execute("SELECT count(*) FROM state").fetchone()
        except sqlite3.Error as e:
            if "not a database" in str(e) or "malformed" in str(e):
                raise StateStoreError(
                    f"{path!r} is not a DLRover state database, or it is corrupt ({e}); it was "
                    "left as it is: restore it from a backup, or pass another --state-db"
                ) from e
            raise StateStoreError(
                f"cannot open the master's state database {path!r}: {e}; "
                "pass a writable path with --state-db"
            ) from e
        self._lock = threading.Lock()

    def get(self, namespace: str, key: str) -> bytes | None:
        """The value of ``key`` in ``namespace``, or None if absent."""
        with self._lock:
            row = self._conn.execute(
                "SELECT value FROM state WHERE namespace=? AND key=?", (namespace, key)
            ).fetchone()
        return None if row is None else bytes(row[0])

    def put(self, namespace: str, key: str, value: bytes) -> None:
        """Insert or replace the row, committed when this returns (WAL with synchronous=NORMAL: it
        survives a process crash, not necessarily a power loss)."""
        with self._lock:
            self._conn.execute(
                "INSERT OR REPLACE INTO state (namespace, key, value) VALUES (?, ?, ?)",
                (namespace, key, sqlite3.Binary(value)),
            )

    def put_many(
        self, namespace: str, values: dict[str, bytes], delete: Collection[str] = ()
    ) -> None:
        """Delete the rows of ``delete``, then insert or replace those of ``values``, in one
        transaction (all of it or none)."""
        with self._lock:
            self._conn.execute("BEGIN")  # the connection autocommits each statement otherwise
            try:
                # (Statements with nothing to do are skipped: the master writes on every
                # sharding call, most of them one or two rows.)
                if delete:
                    self._conn.executemany(
                        "DELETE FROM state WHERE namespace=? AND key=?",
                        [(namespace, k) for k in delete],
                    )
                if values:
                    self._conn.executemany(
                        "INSERT OR REPLACE INTO state (namespace, key, value) VALUES (?, ?, ?)",
                        [(namespace, k, sqlite3.Binary(v)) for k, v in values.items()],
                    )
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def delete(self, namespace: str, key: str) -> None:
        """Delete the row of ``key`` in ``namespace`` if present."""
        with self._lock:
            self._conn.execute("DELETE FROM state WHERE namespace=? AND key=?", (namespace, key))

    def items(self, namespace: str) -> dict[str, bytes]:
        """Every row of ``namespace``."""
        with self._lock:
            rows = self._conn.execute(
                "SELECT key, value FROM state WHERE namespace=?", (namespace,)
            ).fetchall()
        return {k: bytes(v) for k, v in rows}

    def compare_and_set(
        self, namespace: str, key: str, expected: bytes | None, value: bytes
    ) -> bool:
        """Write ``value`` only if the current value equals ``expected`` (None: absent), in one
        IMMEDIATE transaction."""
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
        """Close the database connection; the store cannot be used after."""
        with self._lock:
            self._conn.close()


def open_state_store(spec: str) -> StateStore:
    """`memory` (or empty) -> MemoryStateStore; `redis://...` -> RedisStateStore (a server other
    machines reach, so a master elsewhere can take over); anything else is a SQLite file path."""
    if spec in ("", "memory", ":memory:"):
        return MemoryStateStore()
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisStateStore(spec)
    return SqliteStateStore(spec)
