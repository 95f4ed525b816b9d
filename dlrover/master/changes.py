"""Change notification for the master's long polls: a version counter that waiters watch.

Agents do not poll the master for membership, the end of a rendezvous round or the job's end:
they ask once with a ``wait_s`` and the master holds the call until the answer changes. What
changes the answer (a join, a closed round, a node that left, the job's end) calls `bump()`;
a waiting thread (`wait`) or asyncio task (a `subscribe`d callback) then looks again.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from dlrover.constants import MAX_LONG_POLL_S

T = TypeVar("T")


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


class LongPoll(Generic[T]):
    """One long poll: which change feed wakes it, what it answers once there is something to
    say (``check`` returns None while there is not), what it answers when the wait runs out,
    and when it must look again without a wake-up (a rendezvous round's last call)."""

    def __init__(
        self,
        feed: ChangeFeed,
        check: Callable[[], T | None],
        on_timeout: Callable[[], T],
        wake_at: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.feed = feed
        self.check = check
        self.on_timeout = on_timeout
        self.wake_at = wake_at

    def sleep_s(self, left_s: float, now: float) -> float:
        """How long to wait for a bump before looking again: the time ``left_s`` of the hold,
        or until `wake_at` (``now`` on the same clock); a last call that is over but closed
        nothing is looked at again in 50 ms, never in a busy loop."""
        wake = self.wake_at()
        if wake is None:
            return left_s
        return min(left_s, max(0.05, wake - now))

    def run_here(self, wait_s: float, clock: Callable[[], float]) -> T:
        """Hold this poll in the calling thread for at most `hold_s` (``wait_s``) seconds: its
        answer as soon as there is one, else its timeout answer (``clock``: the master's, for
        `wake_at`, which may be a test's). The gRPC server holds the same polls on its event
        loop instead."""
        deadline = time.monotonic() + hold_s(wait_s)
        while True:
            version = self.feed.version
            answer = self.check()
            if answer is not None:
                return answer
            now = time.monotonic()
            if now >= deadline:
                return self.on_timeout()
            self.feed.wait(version, self.sleep_s(deadline - now, clock()))


def hold_s(wait_s: float) -> float:
    """How long the master holds a long poll that asked for ``wait_s``: at most a random 50-100%
    of MAX_LONG_POLL_S, so that the watches of 10,000 nodes armed in the same second do not all
    come back in the same second ever after."""
    return max(0.0, min(wait_s, MAX_LONG_POLL_S * random.uniform(0.5, 1.0)))
