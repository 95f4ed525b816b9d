"""The agent's heartbeat: liveness, resource usage and progress to the master, actions back."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from dlrover.api.errors import MasterClientError, MasterRequestError, UnknownNodeError
from dlrover.api.master import HeartbeatAction, HeartbeatReport, MasterApi

logger = logging.getLogger(__name__)


class Heartbeat:
    """Sends one heartbeat every `interval_s` from a background thread until `stop()`.

    `snapshot()` gives the request's contents at each beat; the master's answer sets
    `stop_requested` ("stop": the job has ended) or `reregister_requested` (the master took this
    node for lost, or restarted without knowing it), and may stretch the interval: in a big job
    the master asks every node to beat less often, so that all beats together stay within its
    budget (the interval is never shorter than `interval_s`). A master that has answered no beat
    for `lost_timeout_s` (0: never) sets `master_lost`.
    """

    def __init__(
        self,
        master: MasterApi,
        interval_s: float,
        snapshot: Callable[[], HeartbeatReport],
        lost_timeout_s: float = 0.0,
    ) -> None:
        self._master = master
        self._interval_s = interval_s
        self._master_interval_s = 0.0
        self._phased_for = 0.0
        self._snapshot = snapshot
        self._stop = threading.Event()
        self.stop_requested = threading.Event()
        self.reregister_requested = threading.Event()
        self.master_lost = threading.Event()
        self._lost_timeout_s = lost_timeout_s
        self._last_answer = time.monotonic()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="dlrover-heartbeat")

    @property
    def interval_s(self) -> float:
        """The current interval: this agent's own, or longer if the master asked for it."""
        return max(self._interval_s, self._master_interval_s)

    def stretch(self, master_interval_s: float) -> None:
        """Take the interval the master asked for (from its registration answer or a reply)."""
        if master_interval_s != self._master_interval_s and master_interval_s > self._interval_s:
            logger.info("heartbeat every %.1fs, as the master asks", master_interval_s)
        self._master_interval_s = max(0.0, master_interval_s)

    def start(self) -> None:
        """Start the beat thread; call it once."""
        self._thread.start()

    def stop(self) -> None:
        """Stop beating; waits at most one interval + 1 s for a beat in flight."""
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=self.interval_s + 1.0)

    def beat(self) -> None:
        """One heartbeat (the loop's body)."""
        try:
            reply = self._master.heartbeat(self._snapshot())
        except UnknownNodeError as e:
            logger.warning("heartbeat refused: %s", e)
            self._last_answer = time.monotonic()
            self.reregister_requested.set()
            return
        except MasterRequestError as e:
            logger.warning("heartbeat refused: %s", e)
            self._last_answer = time.monotonic()  # refused, but it answers
            return
        except MasterClientError as e:
            silent = time.monotonic() - self._last_answer
            logger.warning("heartbeat failed (no answer for %.0fs): %s", silent, e)
            if self._lost_timeout_s > 0 and silent >= self._lost_timeout_s:
                self.master_lost.set()
            return
        self._last_answer = time.monotonic()
        self.stretch(reply.heartbeat_interval_s)
        if reply.action is HeartbeatAction.STOP:
            self.stop_requested.set()
        elif reply.action is HeartbeatAction.REREGISTER:
            self.reregister_requested.set()

    def next_wait_s(self) -> float:
        """The wait before the next beat. A new interval (the first, or one the master stretched)
        starts at a random phase within it, and later waits vary by 10%: nodes started together
        must not beat together (10,000 beats in one second every 20 s), and that holds only if
        no two agents keep the same phase."""
        interval = self.interval_s
        if interval != self._phased_for:
            self._phased_for = interval
            return random.uniform(0.0, interval)
        return interval * random.uniform(0.9, 1.1)

    def _loop(self) -> None:
        while not self._stop.wait(self.next_wait_s()):
            self.beat()
