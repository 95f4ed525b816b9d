"""Leadership of a job's state: the newest master to claim it leads; an older one stops.

A master taking over a job's state (another machine on a shared Redis state, or the same file
while the old process still runs, e.g. cut off from its nodes) bumps the state's leader epoch
with compare-and-set. Every master checks the epoch on each tick; one that finds a newer epoch
stops serving at once and writes nothing more, so two masters never drive one job for longer
than a tick.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass

from dlrover.master.state_store import StateStore, StateStoreError

_NAMESPACE = "job"
_KEY = "leader"


@dataclass(frozen=True)
class Leader:
    """Who leads a job's state: a master's epoch, host and pid."""

    epoch: int
    host: str
    pid: int

    def describe(self) -> str:
        """For messages: ``pid 123 on host-a (epoch 4)``."""
        return f"pid {self.pid} on {self.host} (epoch {self.epoch})"


def _read(raw: bytes | None) -> Leader | None:
    if raw is None:
        return None
    try:
        d = json.loads(raw)
        return Leader(int(d["epoch"]), str(d["host"]), int(d["pid"]))
    except (ValueError, KeyError, TypeError) as e:
        raise StateStoreError(
            f"the master's state {_NAMESPACE}/{_KEY} is corrupt ({e}); it was left as it is"
        ) from None


class Fence:
    """This master's claim on the state; `superseded()` tells whether a newer master took it."""

    def __init__(self, store: StateStore, leader: Leader) -> None:
        self._store = store
        self.leader = leader

    @classmethod
    def claim(cls, store: StateStore, attempts: int = 20) -> Fence:
        """Become the state's leader: the epoch after the current one (compare-and-set, retried
        against concurrent claims). Raises StateStoreError if ``attempts`` claims all lost."""
        for _ in range(attempts):
            raw = store.get(_NAMESPACE, _KEY)
            current = _read(raw)
            mine = Leader((current.epoch if current else 0) + 1, socket.gethostname(), os.getpid())
            value = json.dumps(mine.__dict__, sort_keys=True).encode()
            if store.compare_and_set(_NAMESPACE, _KEY, raw, value):
                return cls(store, mine)
            time.sleep(0.01)  # another master claimed at the same moment: read and try again
        raise StateStoreError(f"could not claim the job's state in {store}: it keeps changing")

    def superseded(self) -> Leader | None:
        """The newer leader if another master claimed the state since, else None. A store that
        cannot be read is not taken for a takeover (the next check asks again)."""
        try:
            current = _read(self._store.get(_NAMESPACE, _KEY))
        except StateStoreError:
            return None
        if current is not None and current.epoch > self.leader.epoch:
            return current
        return None
