"""Backoff, the one growing pause between attempts."""

from __future__ import annotations

import pytest

from dlrover.backoff import Backoff


def test_pauses_double_up_to_the_cap_and_start_over_after_a_success():
    backoff = Backoff(0.1, 0.5)
    assert [backoff.next() for _ in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]
    backoff.reset()
    assert backoff.next() == 0.1


def test_a_first_pause_above_the_cap_is_waited_once_then_the_cap():
    backoff = Backoff(20.0, 10.0)
    assert [backoff.next() for _ in range(3)] == [20.0, 10.0, 10.0]


def test_nonsense_is_refused_with_what_is_needed():
    with pytest.raises(ValueError, match="factor >= 1"):
        Backoff(0.1, 1.0, factor=0.5)
    with pytest.raises(ValueError, match="first_s >= 0"):
        Backoff(-1.0, 1.0)
