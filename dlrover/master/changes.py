"""Change notification for the master's long polls: a version counter that waiters watch.

Agents do not poll the master for membership, the end of a rendezvous round or the job's end:
they ask once with a ``wait_s`` and the master holds the call until the answer changes. What
changes the answer (a join, a closed round, a node that left, the job's end) calls `bump()`;
a waiting thread (`wait`) or asyncio task (a `subscribe`d callback) then looks again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class ChangeFeed:
    """A monotonically increasing version, bumped on every change a long poll may wait for."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._version = 0
        self._listeners: list[Callable[[], None]] = []

    @property
    def version(self) -> int:
        """The current version; a waiter reads it before looking at the state it waits on."""
        with self._cond:
            return self._version

    def bump(self) -> None:
        """Something changed: wake every waiter. Cheap; safe from any thread."""
        with self._cond:
            self._version += 1
            self._cond.notify_all()
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def wait(self, version: int, timeout_s: float) -> int:
        """Block until the version differs from ``version`` or ``timeout_s`` passed; returns the
        version then."""
        with self._cond:
            self._cond.wait_for(lambda: self._version != version, timeout=max(0.0, timeout_s))
            return self._version

    def subscribe(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (from the bumping thread, so it must be quick and thread-safe) on
        every bump; an asyncio server hands the wake-up to its loop from there."""
        with self._cond:
            self._listeners.append(listener)

    def unsubscribe(self, listener: Callable[[], None]) -> None:
        """Stop calling ``listener``; unknown listeners are ignored."""
        with self._cond:
            if listener in self._listeners:
                self._listeners.remove(listener)
