"""Launches on their way to the engine: bounded, no faster than the engine's API takes them.

A rack lost at once means hundreds of replacements in the same second. Handed to the engine all
together, a Kubernetes API server answers most of them 429 (or its client throttles them one by
one while the controller's loop waits), and before this queue one refused launch failed the job.
Here every launch the node controller makes (the job's first nodes, each replacement) is queued
once per node id, and `pump` hands over at most what the engine's `launch_rate` allows since
the last hand-over (a token bucket holding one second's worth), in parallel batches, from the
controller's own loop: engine events and the job's calls are served between batches. A launch
the engine still refuses for now (`RateLimitedError`) goes back to the front of the queue and is
handed over again after the wait the engine asked for; any other failure is the caller's, as
before.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from dlrover.engines.base import (
    Engine,
    EngineError,
    LaunchManyError,
    Node,
    NodeSpec,
    RateLimitedError,
)

logger = logging.getLogger(__name__)

HEADROOM = 0.95
"""Hand over at this share of the engine's declared rate: its own bucket, started earlier and
on its own clock, then always holds a launch when the queue sends one."""


class TokenBucket:
    """``rate`` tokens a second, holding at most one second's worth (at least one token)."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self._clock = clock
        self._most = max(1.0, rate)
        self._tokens = self._most
        self._filled_at = clock()

    def available(self) -> float:
        """The tokens there are now."""
        now = self._clock()
        self._tokens = min(self._most, self._tokens + (now - self._filled_at) * self.rate)
        self._filled_at = now
        return self._tokens

    def take(self, count: float) -> None:
        """Spend ``count`` tokens (the caller checked `available`)."""
        self._tokens -= count

    def wait_s(self) -> float:
        """Seconds until a token is there (0: now)."""
        return max(0.0, (1 - self.available()) / self.rate)


class LaunchQueueFullError(EngineError):
    """More launches queued than the queue holds (more than the job has slots)."""


@dataclasses.dataclass
class _Queued:
    spec: NodeSpec
    since: float
    """When it was queued (its hand-over time is measured from here)."""
    not_before: float
    """Not handed over again before this (the engine asked to wait)."""


@dataclasses.dataclass
class LaunchStats:
    """What the queue did, for status and the scale benchmark."""

    handed: int = 0
    """Launches the engine accepted."""
    refused_for_now: int = 0
    """Launches the engine refused with RateLimitedError (each handed over again)."""
    max_wait_s: float = 0.0
    """Longest time from queued to accepted."""


class LaunchQueue:
    """Node launches waiting for the engine, in order, at most ``capacity``, one per node id."""

    def __init__(
        self,
        engine: Engine,
        capacity: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self.capacity = capacity
        self._clock = clock
        self._queue: deque[_Queued] = deque()
        self._by_id: dict[str, _Queued] = {}
        """The queued launches by node id (one each)."""
        rate = engine.launch_rate
        self._bucket = None if rate is None else TokenBucket(rate * HEADROOM, clock)
        """None: the engine takes launches as fast as they come."""
        self.stats = LaunchStats()

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, specs: Sequence[NodeSpec]) -> None:
        """Queue launches; a node id already queued is not queued twice (the newer spec wins).
        Raises LaunchQueueFullError past ``capacity``."""
        now = self._clock()
        for spec in specs:
            queued = self._by_id.get(spec.node_id)
            if queued is not None:
                queued.spec = spec
                continue
            if len(self._queue) >= self.capacity:
                raise LaunchQueueFullError(
                    f"{len(self._queue)} launches already wait for the engine "
                    f"(the most this job can have): {spec.node_id} is not queued"
                )
            queued = self._by_id[spec.node_id] = _Queued(spec, now, now)
            self._queue.append(queued)

    def next_due_s(self) -> float | None:
        """Seconds until `pump` may hand something over (0: now); None when nothing waits."""
        if not self._queue:
            return None
        now = self._clock()
        head = max(0.0, min(q.not_before for q in self._queue) - now)
        return head if self._bucket is None else max(head, self._bucket.wait_s())

    def pump(self) -> list[Node]:
        """Hand over what the engine's rate allows now (in parallel); returns the nodes it
        accepted. A launch refused for now is queued again; other failures raise
        LaunchManyError (the launched nodes in it) after the whole batch was tried."""
        now = self._clock()
        room = len(self._queue) if self._bucket is None else int(self._bucket.available())
        batch: list[_Queued] = []
        kept: deque[_Queued] = deque()
        for q in self._queue:  # in order; those the engine asked to wait stay where they are
            if len(batch) < room and q.not_before <= now:
                batch.append(q)
            else:
                kept.append(q)
        if not batch:
            return []
        self._queue = kept
        for q in batch:
            del self._by_id[q.spec.node_id]
        if self._bucket is not None:
            self._bucket.take(len(batch))
        try:
            launched = self._engine.launch_many([q.spec for q in batch])
            failures: dict[str, EngineError] = {}
        except LaunchManyError as e:
            launched, failures = e.launched, e.failures
        accepted = self._clock()
        later: list[_Queued] = []
        errors: dict[str, EngineError] = {}
        for q in batch:
            error = failures.get(q.spec.node_id)
            if error is None:
                self.stats.handed += 1
                self.stats.max_wait_s = max(self.stats.max_wait_s, accepted - q.since)
            elif isinstance(error, RateLimitedError):
                self.stats.refused_for_now += 1
                q.not_before = accepted + error.retry_after_s
                later.append(q)
                self._by_id[q.spec.node_id] = q
            else:
                errors[q.spec.node_id] = error
        if later:
            logger.info(
                "the engine refused %d launch(es) for now; handing them over again in %.1fs",
                len(later),
                min(q.not_before for q in later) - accepted,
            )
            self._queue.extendleft(reversed(later))
        if errors:
            raise LaunchManyError(launched, errors)
        return launched
