"""How many shards and samples each rank of a synchronous job takes from one leased epoch."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dlrover.sharding.errors import InvalidSpecError, ShardingError
from dlrover.sharding.types import DatasetSpec, Position


class LockstepError(ShardingError):
    """The ranks of a synchronous job would read different numbers of samples in one epoch (or
    a rank got more than its share): going on would leave a rank waiting in a collective.
    Raised on the trainer side only, so it has no wire kind."""


@dataclass(frozen=True)
class LockstepQuota:
    """What every rank takes in one iteration (epoch) of a lockstep reader.

    Each rank leases at most ``shards`` shards and yields exactly ``samples`` indices: its
    shards' samples, then repeats of them (padding). Invariants: no ``shards`` of the shards
    left hold more than ``samples`` samples, so no rank runs over; and, without drop_last,
    ``shards x world_size`` >= the shards left, so every one is read by some rank.
    """

    shards: int
    samples: int
    shards_left: int
    """Shards of the epoch still to read when the iteration starts."""
    samples_left: int
    """Samples of the epoch still to read when the iteration starts."""


def shards_left(spec: DatasetSpec, position: Position | None) -> tuple[int, list[int]]:
    """The shards of the epoch not yet read, as (how many are whole shards of
    ``samples_per_shard``, the lengths of the others): all of them without a ``position``;
    else the pending ones (what is left of each) and those from the position's cursor on."""
    size = spec.samples_per_shard
    count = spec.num_shards
    if count == 0:
        return 0, []
    last = spec.shard_length(count - 1)
    if position is None:
        return (count, []) if last == size else (count - 1, [last])
    untouched = count - position.cursor
    others: list[int] = []
    if last != size and spec.shard_ordinal(position.epoch, count - 1) >= position.cursor:
        untouched -= 1  # the short last shard is among those not handed out yet
        others.append(last)
    for _, index, offset in position.pending:
        length = spec.shard_length(index) - offset
        if length == size:
            untouched += 1
        else:
            others.append(length)
    return untouched, others


def lockstep_quota(
    spec: DatasetSpec, world_size: int, drop_last: bool = False, position: Position | None = None
) -> LockstepQuota:
    """The quota of every rank for the rest of an epoch (all of it without ``position``).

    Without ``drop_last`` each rank may take ceil(shards left / world) shards, so all are read;
    with it floor(...), and the few shards over stay unread this iteration. ``samples`` is the
    most that many shards can hold: the whole shards first, then the longest of the others.
    Every rank computes the same quota from the same spec, world size and position.
    """
    if world_size < 1:
        raise InvalidSpecError(f"world size must be >= 1, got {world_size}")
    whole, others = shards_left(spec, position)
    count = whole + len(others)
    shards = count // world_size if drop_last else math.ceil(count / world_size)
    from_whole = min(shards, whole)
    samples = from_whole * spec.samples_per_shard
    samples += sum(sorted(others, reverse=True)[: shards - from_whole])
    return LockstepQuota(shards, samples, count, whole * spec.samples_per_shard + sum(others))
