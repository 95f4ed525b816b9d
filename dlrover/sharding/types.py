"""Specs, shards, positions and results exchanged between the sharding master and clients."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dlrover.sharding.config import DEFAULT_LEASE_S, DEFAULT_MAX_RETRIES
from dlrover.sharding.errors import InvalidSpecError
from dlrover.sharding.permutation import mix64, permute, shuffled_range, unpermute


class DeliveryMode(str, enum.Enum):
    """How often each sample is trained per epoch when workers fail.

    AT_LEAST_ONCE: a failed worker's whole shard is handed out again (some samples twice).
    EXACTLY_ONCE: partial progress is tracked per shard, and the consumed position taken with a
    checkpoint is restored with it, so the model sees each sample once.
    AT_MOST_ONCE: nothing handed out is ever handed out again: a failed worker's shards are
    dropped, and what it had not reported trained is counted lost (``lost_samples``), never
    silently; a checkpoint's position is not restored (it would hand out again what was).
    """

    AT_LEAST_ONCE = "at-least-once"
    EXACTLY_ONCE = "exactly-once"
    AT_MOST_ONCE = "at-most-once"


@dataclass(frozen=True)
class DatasetSpec:
    """What a finite dataset looks like to the master. Equal specs mean the same dataset."""

    name: str
    """Registry key; every worker reading the dataset uses the same name."""
    size: int
    """Number of samples, indexed 0..size-1."""
    shard_size: int = 0
    """Samples per shard; 0 means batch_size * batches_per_shard."""
    batch_size: int = 0
    """Micro-batch size, used only to derive shard_size."""
    batches_per_shard: int = 0
    """Batches per shard, used only to derive shard_size."""
    epochs: int = 1
    """Number of passes over the dataset."""
    shuffle: bool = False
    """Shuffle shard order per epoch and sample order within a shard (both from `seed`)."""
    seed: int = 0
    """Root seed of every shuffle; the same seed gives the same order on every run."""
    mode: DeliveryMode = DeliveryMode.AT_LEAST_ONCE
    """Delivery guarantee, see DeliveryMode."""
    max_retries: int = DEFAULT_MAX_RETRIES
    """How many times one shard may be handed out again (worker lost or lease expired)."""
    lease_s: float = DEFAULT_LEASE_S
    """Seconds a worker may hold a shard without reporting before it is reassigned."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", DeliveryMode(self.mode))
        problems: list[str] = []
        if not self.name:
            problems.append("name must not be empty")
        if self.size < 0:
            problems.append(f"size must be >= 0, got {self.size}")
        if self.shard_size < 0 or self.batch_size < 0 or self.batches_per_shard < 0:
            problems.append("shard_size, batch_size and batches_per_shard must be >= 0")
        if self.shard_size == 0 and self.batch_size * self.batches_per_shard == 0:
            problems.append("give shard_size, or batch_size and batches_per_shard")
        if self.epochs < 1:
            problems.append(f"epochs must be >= 1, got {self.epochs}")
        if self.max_retries < 0:
            problems.append(f"max_retries must be >= 0, got {self.max_retries}")
        if self.lease_s <= 0:
            problems.append(f"lease_s must be > 0, got {self.lease_s}")
        if problems:
            raise InvalidSpecError(f"dataset {self.name!r}: " + "; ".join(problems))

    @property
    def samples_per_shard(self) -> int:
        """Samples in each shard (the last one may have fewer): ``shard_size``, or ``batch_size *
        batches_per_shard``."""
        return self.shard_size or self.batch_size * self.batches_per_shard

    @property
    def num_shards(self) -> int:
        """Shards per epoch: ``size / samples_per_shard``, rounded up."""
        return -(-self.size // self.samples_per_shard)

    def shard_length(self, index: int) -> int:
        """Samples in shard ``index``: ``samples_per_shard``, fewer for the last one."""
        start = index * self.samples_per_shard
        return max(0, min(start + self.samples_per_shard, self.size) - start)

    def shard_index(self, epoch: int, ordinal: int) -> int:
        """Which shard the master hands out ``ordinal``-th in ``epoch``: the seeded order with
        ``shuffle``, else dataset order. Both sides compute it; nothing of it is stored."""
        if not self.shuffle:
            return ordinal
        return permute(ordinal, self.num_shards, mix64(self.seed, 0, epoch))

    def shard_ordinal(self, epoch: int, index: int) -> int:
        """The inverse of ``shard_index``: when in ``epoch`` shard ``index`` is handed out."""
        if not self.shuffle:
            return index
        return unpermute(index, self.num_shards, mix64(self.seed, 0, epoch))

    def to_dict(self) -> dict[str, Any]:
        """The JSON form kept in the master's saved state (the wire uses dlrover.api.mapper).
        Every field is a scalar: a copy of the instance's attributes, not `asdict`'s deep copy
        (a third of a lease's cost in the master, which saves the state on each call)."""
        data = dict(vars(self))
        data["mode"] = self.mode.value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DatasetSpec:
        """Rebuild from ``to_dict()``; raises InvalidSpecError for unknown fields, a missing name or
        size, or values that cannot work."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown or "name" not in data or "size" not in data:
            raise InvalidSpecError(
                f"dataset spec {data.get('name')!r}: unknown fields {unknown} or missing "
                f"name/size; fields are {sorted(known)}"
            )
        return cls(**data)


@dataclass(frozen=True, order=True)
class ShardId:
    """Names one shard of one epoch: `index` is its place in dataset order (its sample range)."""

    epoch: int
    index: int

    def __str__(self) -> str:
        return f"epoch {self.epoch} shard {self.index}"


@dataclass(frozen=True)
class Shard:
    """A lease on the samples [start, end) of a dataset, of which `offset` are already consumed.

    With `shuffle`, samples are visited in the seeded order `shuffled_range(end - start, seed)`;
    `offset` counts positions in that order, so a partly consumed shard resumes exactly.
    """

    dataset: str
    id: ShardId
    start: int
    end: int
    offset: int = 0
    shuffle: bool = False
    seed: int = 0
    attempt: int = 0
    """0 on first hand-out, then +1 each time it came back (worker lost, lease expired)."""

    def __len__(self) -> int:
        return self.end - self.start

    def indices(self) -> Iterator[int]:
        """Sample indices still to consume, in the shard's order."""
        length = self.end - self.start
        if not self.shuffle:
            return iter(range(self.start + self.offset, self.end))
        order = shuffled_range(length, self.seed)
        return (self.start + position for position in order[self.offset :])


def shard_seed(root_seed: int, shard_id: ShardId) -> int:
    """Seed of the within-shard sample order; derived, so it is never stored."""
    return mix64(root_seed, 1, shard_id.epoch, shard_id.index) >> 1


@dataclass(frozen=True)
class Position:
    """What of a dataset has been consumed, as ranges: checkpoint it, restore it later.

    Every shard of epochs before `epoch`, and the first `cursor` shards (in issue order) of
    `epoch`, are consumed, except those listed in `pending` as [epoch, index, offset]: of those
    only the first `offset` samples (in shard order) are consumed.
    """

    dataset: str
    epoch: int
    cursor: int
    pending: tuple[tuple[int, int, int], ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form a checkpoint keeps (the sampler's state_dict; the wire has its own)."""
        return {
            "dataset": self.dataset,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "pending": [list(entry) for entry in self.pending],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Position:
        """Rebuild from ``to_dict()`` (a checkpoint's sampler state); ``pending`` may be absent, a
        missing dataset, epoch or cursor raises KeyError."""
        pending = tuple((int(e[0]), int(e[1]), int(e[2])) for e in data.get("pending", []))
        return cls(str(data["dataset"]), int(data["epoch"]), int(data["cursor"]), pending)


@dataclass(frozen=True)
class ConsumptionMark:
    """Where a worker stands in its iteration `epoch` (the dataset epoch it is reading).

    With a shard: the worker is about to yield that shard's samples from `offset` on, and they
    occupy [begin, begin + length - offset) of the samples it consumes in this iteration.
    Without one: the iteration ended after `begin` samples.
    """

    epoch: int
    begin: int
    shard_id: ShardId | None = None
    offset: int = 0


@dataclass(frozen=True)
class PositionAt:
    """Answer to position_at: the position, or the workers whose marks do not reach the asked
    step yet (ask again shortly; in a synchronous job they have already reported)."""

    position: Position | None
    waiting_for: tuple[str, ...] = ()


@dataclass(frozen=True)
class RegisterResult:
    """Answer to register_dataset: `created` is False when it already existed (a no-op)."""

    dataset: str
    created: bool


@dataclass(frozen=True)
class FetchResult:
    """Answer to fetch_shards: leased shards; `finished` once every epoch is fully consumed.

    No shards and not finished means all remaining shards are leased to others right now:
    ask again later (they come back if their holders fail).
    """

    shards: tuple[Shard, ...]
    finished: bool


@dataclass(frozen=True)
class ReportResult:
    """Answer to report_done: how many reports counted and how many named no open shard."""

    accepted: int
    ignored: int


@dataclass(frozen=True)
class DatasetProgress:
    """Counters for one dataset, for logs, metrics and tests."""

    dataset: str
    epoch: int
    todo: int
    """Shards not yet handed out in the current epoch plus those returned to the queue."""
    leased: int
    done_shards: int
    """Shards reported done since registration (or the last restore), all epochs."""
    finished: bool
    lost_shards: int = 0
    """At-most-once: shards dropped with a lost worker (or an expired lease), never handed out
    again."""
    lost_samples: int = 0
    """At-most-once: samples of those shards the worker had not reported trained."""
