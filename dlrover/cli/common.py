"""Shared CLI pieces: logging set-up (`dlrover.log`) and argument parsers for node counts and
stream specs."""

from __future__ import annotations

from dlrover.log import setup_logging

__all__ = ["parse_nnodes", "parse_std_spec", "setup_logging"]


def parse_nnodes(value: str) -> tuple[int, int]:
    """`N` or `MIN:MAX` -> (min, max); raises ValueError with a message for the user."""
    parts = value.split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise ValueError(f"--nnodes {value!r}: expected N or MIN:MAX, e.g. 2 or 1:4") from None
    if lo < 1:
        raise ValueError(f"--nnodes {value!r}: the number of nodes must be at least 1")
    if lo > hi:
        raise ValueError(f"--nnodes {value!r}: MIN ({lo}) is greater than MAX ({hi})")
    return lo, hi


def parse_std_spec(value: str, flag: str) -> tuple[int, dict[int, int]]:
    """torchrun's -r/-t syntax: `3` (all local ranks) or `0:1,1:2` (per local rank).

    0 = nothing, 1 = stdout, 2 = stderr, 3 = both. Returns (default, per-rank overrides).
    """

    def bits(v: str) -> int:
        n = int(v)
        if n not in (0, 1, 2, 3):
            raise ValueError
        return n

    try:
        if ":" not in value:
            return bits(value), {}
        per_rank: dict[int, int] = {}
        for item in value.split(","):
            rank, v = item.split(":")
            per_rank[int(rank)] = bits(v)
        return 0, per_rank
    except ValueError:
        raise ValueError(
            f"{flag} {value!r}: expected 0 (none), 1 (stdout), 2 (stderr), 3 (both), "
            "or per local rank like 0:1,1:2"
        ) from None
