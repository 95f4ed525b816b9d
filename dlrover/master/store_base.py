"""The master's StateStore interface and its errors (every backend implements it)."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import Any


class StateStoreError(Exception):
    """The master's state could not be read or written."""


class StateMismatchError(StateStoreError):
    """The state belongs to another job (another token or job name)."""


class StateStore(ABC):
    """Namespaced key -> bytes storage with compare-and-set.

    Invariant: a `put` that returned is durable for the store's lifetime (for the SQLite store,
    across process restarts); a failed write leaves the previous value intact.
    """

    @abstractmethod
    def get(self, namespace: str, key: str) -> bytes | None:
        """The value of ``key`` in ``namespace``, or None if absent."""
        ...

    @abstractmethod
    def put(self, namespace: str, key: str, value: bytes) -> None:
        """Write ``value``; durable once this returns (see the class invariant)."""
        ...

    @abstractmethod
    def delete(self, namespace: str, key: str) -> None:
        """Remove ``key`` from ``namespace``; an absent key is not an error."""
        ...

    @abstractmethod
    def items(self, namespace: str) -> dict[str, bytes]:
        """Every key of ``namespace`` with its value, as a snapshot."""
        ...

    @abstractmethod
    def compare_and_set(
        self, namespace: str, key: str, expected: bytes | None, value: bytes
    ) -> bool:
        """Write `value` only if the current value equals `expected` (None: absent)."""

    def put_many(
        self, namespace: str, values: dict[str, bytes], delete: Collection[str] = ()
    ) -> None:
        """Write every value of ``values`` (a round's members) and remove the keys of ``delete``
        (a key in both is written): one transaction where the backend has them; this default
        does it one by one."""
        for key in delete:
            if key not in values:
                self.delete(namespace, key)
        for key, value in values.items():
            self.put(namespace, key, value)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the store's resources; the default does nothing."""
        pass

    def get_json(self, namespace: str, key: str) -> Any:
        """The value decoded from JSON, or None if absent."""
        raw = self.get(namespace, key)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
            raise StateStoreError(
                f"the master's state {namespace}/{key} in {self} is corrupt ({e}); it was left "
                "as it is: restore the file from a backup, or start the job on a new state"
            ) from None

    def put_json(self, namespace: str, key: str, value: Any) -> None:
        """Write ``value`` as JSON (sorted keys, so equal values give equal bytes)."""
        self.put(namespace, key, json.dumps(value, sort_keys=True).encode())

    def put_json_many(
        self, namespace: str, values: dict[str, Any], delete: Collection[str] = ()
    ) -> None:
        """`put_json` of each value and the removal of each key of ``delete``, in one
        `put_many`."""
        if values or delete:
            encoded = {k: json.dumps(v, sort_keys=True).encode() for k, v in values.items()}
            self.put_many(namespace, encoded, delete)
