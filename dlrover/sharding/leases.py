"""Who holds which shard until when: the lease table shared by dataset and stream queues."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

Key = TypeVar("Key", bound=Hashable)


@dataclass
class Lease:
    """One shard held by one worker; `offset` is its reported progress within the shard."""

    worker_id: str
    deadline: float
    attempt: int
    offset: int = 0


class LeaseTable(Generic[Key]):
    """Maps a shard key to its lease. Invariant: a key is held by at most one worker at a time.

    Once `track`ed, the table also keeps which keys changed since `changes_saved` (granted,
    released, or `touch`ed), so that its owner can save the changes rather than the whole
    table."""

    def __init__(self) -> None:
        self._leases: dict[Key, Lease] = {}
        self._by_worker: dict[str, dict[Key, None]] = {}
        """Each worker's keys, in the order granted: a worker's renewal or loss touches its
        own leases, not every lease of the job."""
        self._changed: dict[Key, Lease | None] | None = None

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, key: object) -> bool:
        return key in self._leases

    def items(self) -> list[tuple[Key, Lease]]:
        """A snapshot list of (key, lease) pairs."""
        return list(self._leases.items())

    def get(self, key: Key) -> Lease | None:
        """The lease on ``key``, or None if no worker holds it."""
        return self._leases.get(key)

    def grant(self, key: Key, lease: Lease) -> None:
        """Lease ``key``; raises AssertionError if it is already leased (a bug in the caller, never
        a user error)."""
        if key in self._leases:
            # A double grant would hand one shard to two workers: a bug, never a user error.
            raise AssertionError(f"{key} is already leased to {self._leases[key].worker_id}")
        self._leases[key] = lease
        self._by_worker.setdefault(lease.worker_id, {})[key] = None
        if self._changed is not None:
            self._changed[key] = lease

    def release(self, key: Key) -> Lease | None:
        """Remove the lease on ``key`` and return it; None if it was not leased."""
        lease = self._leases.pop(key, None)
        if lease is None:
            return None
        held = self._by_worker[lease.worker_id]
        del held[key]
        if not held:
            del self._by_worker[lease.worker_id]
        if self._changed is not None:
            self._changed[key] = None
        return lease

    def touch(self, key: Key) -> None:
        """The lease on ``key`` changed in place (its offset): count it among the changes."""
        if self._changed is not None and key in self._leases:
            self._changed[key] = self._leases[key]

    def track(self) -> None:
        """Keep the changes from now on, every lease held now counted as changed (a table not
        saved key by key yet); nothing is kept until this is called."""
        if self._changed is None:
            self._changed = dict(self._leases)

    def changes(self) -> dict[Key, Lease | None]:
        """The leases changed since `changes_saved` (None: released), as they are now (empty
        for a table that is not tracked). Kept until `changes_saved`, so a write of them that
        fails is made again with the next."""
        return dict(self._changed) if self._changed else {}

    def changes_saved(self) -> None:
        """The changes `changes` returned are saved: start counting again."""
        if self._changed:
            self._changed = {}

    def renew(self, worker_id: str, deadline: float) -> int:
        """Push back the deadline of every lease `worker_id` holds; returns how many."""
        keys = self._by_worker.get(worker_id, {})
        for key in keys:
            lease = self._leases[key]
            lease.deadline = max(lease.deadline, deadline)
        return len(keys)

    def held_by(self, worker_id: str) -> list[Key]:
        """The keys ``worker_id`` holds."""
        return list(self._by_worker.get(worker_id, ()))

    def expired(self, now: float) -> list[Key]:
        """The keys whose deadline is at or before ``now``."""
        return [key for key, lease in self._leases.items() if lease.deadline <= now]

    def clear(self) -> None:
        """Drop every lease."""
        if self._changed is not None:
            self._changed.update(dict.fromkeys(self._leases))
        self._leases.clear()
        self._by_worker.clear()
