"""Riding out a master restart: calls that try again while the master is unreachable."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from dlrover.api.errors import MasterUnreachableError
from dlrover.backoff import Backoff

T = TypeVar("T")

logger = logging.getLogger(__name__)


def while_unreachable(call: Callable[[], T], deadline: float, what: str) -> T:
    """Run ``call``; while the master does not answer (it is restarting, or the network is
    down), try again with a growing pause (0.05 s .. 1 s) until the monotonic ``deadline``,
    then raise the last MasterUnreachableError. Every other error is raised at once."""
    backoff = Backoff(0.05, 1.0)
    warned = False
    while True:
        try:
            return call()
        except MasterUnreachableError as e:
            pause = backoff.next()
            if time.monotonic() + pause >= deadline:
                raise
            if not warned:
                logger.warning("%s: the master does not answer (%s); trying again", what, e)
                warned = True
        time.sleep(pause)  # nothing to wait on: the master is another process, perhaps gone
