"""`Backoff`: the one growing pause between attempts (first pause, doubled each time, capped)."""

from __future__ import annotations


class Backoff:
    """The pauses between attempts at something that failed: ``first_s``, then ``factor``
    times the last, never more than ``cap_s`` (after the first); `reset()` after a success
    starts over.

    It only counts: the caller waits the pause it is given on whatever it can wake on (an
    Event, a Condition, or `time.sleep` when there is nothing to wait on).
    """

    def __init__(self, first_s: float, cap_s: float, factor: float = 2.0) -> None:
        if not (first_s >= 0 and cap_s >= 0 and factor >= 1):
            raise ValueError(
                f"Backoff({first_s}, {cap_s}, factor={factor}): need first_s >= 0, cap_s >= 0 "
                "and factor >= 1"
            )
        self.first_s = first_s
        self.cap_s = cap_s
        self.factor = factor
        self._pause_s = first_s

    def next(self) -> float:
        """The pause to wait now (seconds); the one after it grows."""
        pause = self._pause_s
        self._pause_s = min(pause * self.factor, self.cap_s)
        return pause

    def reset(self) -> None:
        """An attempt succeeded: the next pause is ``first_s`` again."""
        self._pause_s = self.first_s
