"""Todo and in-progress queues of one finite dataset, kept as a cursor plus a few ranges."""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from dlrover.sharding.errors import (
    InvalidPositionError,
    InvalidSpecError,
    ShardRetriesExhaustedError,
)
from dlrover.sharding.leases import Lease, LeaseTable
from dlrover.sharding.ledger import Ledgers
from dlrover.sharding.types import (
    ConsumptionMark,
    DatasetProgress,
    DatasetSpec,
    DeliveryMode,
    FetchResult,
    Position,
    PositionAt,
    ReportResult,
    Shard,
    ShardId,
    shard_seed,
)

logger = logging.getLogger(__name__)

# (epoch, index, offset, attempt) of a shard returned to the head of the queue.
_Requeued = tuple[int, int, int, int]


class DatasetQueue:
    """Hands out the shards of one dataset, epoch after epoch, and takes failed ones back.

    The todo queue is `requeued` (shards that came back, served first) followed by the shards
    of the current epoch from `cursor` on, in a seeded order computed on demand. In progress
    are the leases. A shard is done once reported; nothing records done shards one by one,
    so the state stays the size of the shards in flight, whatever the dataset size.
    """

    def __init__(self, spec: DatasetSpec) -> None:
        self.spec = spec
        self.epoch = 0
        self.cursor = 0
        self.requeued: deque[_Requeued] = deque()
        self.leases: LeaseTable[ShardId] = LeaseTable()
        self.done_shards = 0
        self.failure: str | None = None
        self.restore_token: str | None = None
        self.ledgers: Ledgers[ShardId] = Ledgers()
        self.lost_shards = 0
        """At-most-once: shards dropped with their worker, never handed out again."""
        self.lost_samples = 0
        """At-most-once: samples handed out that the job's model never trained: those of the
        dropped shards a worker had not reported trained, recounted at a restore (see
        restore)."""
        self.dropped: dict[ShardId, int] = {}
        """At-most-once: the shards dropped since the last restore and the samples counted."""

    # --- hand-out -------------------------------------------------------------------------
    def fetch(self, worker_id: str, max_count: int, now: float) -> FetchResult:
        """Lease up to ``max_count`` shards to ``worker_id`` until ``now + lease_s``: requeued
        shards first, then the current epoch's from the cursor (the next epoch starts as soon as
        this one is all handed out). Fewer, or none, when the rest is leased to others. Raises
        InvalidSpecError for ``max_count`` < 1, ShardRetriesExhaustedError once a shard was lost
        more than ``max_retries`` times."""
        if max_count < 1:
            raise InvalidSpecError(f"fetch of dataset {self.spec.name!r}: max_count must be >= 1")
        self._raise_if_failed()
        shards: list[Shard] = []
        while len(shards) < max_count:
            entry = self._next_todo()
            if entry is None:
                break
            epoch, index, offset, attempt = entry
            shard_id = ShardId(epoch, index)
            self.leases.grant(shard_id, Lease(worker_id, now + self.spec.lease_s, attempt, offset))
            shards.append(self._shard(shard_id, offset, attempt))
        return FetchResult(tuple(shards), self.finished)

    def _next_todo(self) -> _Requeued | None:
        if self.requeued:
            return self.requeued.popleft()
        num_shards = self.spec.num_shards
        # Start the next epoch as soon as the current one is all handed out: fast workers
        # keep going while the last shards of the previous epoch are still in flight.
        if self.cursor >= num_shards and self.epoch + 1 < self.spec.epochs:
            self.epoch += 1
            self.cursor = 0
        if self.cursor >= num_shards:
            return None
        index = self._index_at(self.epoch, self.cursor)
        self.cursor += 1
        return (self.epoch, index, 0, 0)

    def _index_at(self, epoch: int, ordinal: int) -> int:
        return self.spec.shard_index(epoch, ordinal)

    def _shard(self, shard_id: ShardId, offset: int, attempt: int) -> Shard:
        size = self.spec.samples_per_shard
        start = shard_id.index * size
        return Shard(
            dataset=self.spec.name,
            id=shard_id,
            start=start,
            end=min(start + size, self.spec.size),
            offset=offset,
            shuffle=self.spec.shuffle,
            seed=shard_seed(self.spec.seed, shard_id) if self.spec.shuffle else 0,
            attempt=attempt,
        )

    @property
    def finished(self) -> bool:
        """True once the last epoch is all handed out, nothing is requeued and no lease is open
        (always, for an empty dataset)."""
        return (
            self.epoch == self.spec.epochs - 1
            and self.cursor >= self.spec.num_shards
            and not self.requeued
            and len(self.leases) == 0
        ) or (self.spec.num_shards == 0)

    # --- reports --------------------------------------------------------------------------
    def report_done(self, worker_id: str, shard_ids: list[ShardId]) -> ReportResult:
        """Mark shards done and release their leases. A shard now leased to another worker (its
        lease expired and moved on) still counts, as does a requeued one; a shard neither leased nor
        requeued is ignored."""
        accepted = ignored = 0
        for shard_id in shard_ids:
            lease = self.leases.release(shard_id)
            if lease is None and not self._drop_requeued(shard_id):
                ignored += 1
                continue
            if lease is not None and lease.worker_id != worker_id:
                # The lease had expired and moved on; the samples were still trained, so the
                # shard counts as done and the new holder's later report is ignored.
                logger.info(
                    "%s of %r done by former holder %s", shard_id, self.spec.name, worker_id
                )
            accepted += 1
            self.done_shards += 1
        return ReportResult(accepted, ignored)

    def _drop_requeued(self, shard_id: ShardId) -> bool:
        for entry in self.requeued:
            if (entry[0], entry[1]) == (shard_id.epoch, shard_id.index):
                self.requeued.remove(entry)
                return True
        return False

    def report_progress(self, worker_id: str, shard_id: ShardId, consumed: int, now: float) -> bool:
        """Record that the first `consumed` samples (shard order) are trained; renews the lease."""
        lease = self.leases.get(shard_id)
        if lease is None or lease.worker_id != worker_id:
            return False
        length = len(self._shard(shard_id, 0, 0))
        if not 0 <= consumed <= length:
            raise InvalidSpecError(
                f"progress of {shard_id} in {self.spec.name!r}: consumed={consumed} is outside "
                f"0..{length}, the shard's length"
            )
        if consumed > lease.offset:
            lease.offset = consumed
            self.leases.touch(shard_id)
        lease.deadline = max(lease.deadline, now + self.spec.lease_s)
        return True

    def mark(self, worker_id: str, mark: ConsumptionMark) -> None:
        """Record where `worker_id` stands in its iteration (see ConsumptionMark)."""
        length = 0
        if mark.shard_id is not None:
            shard = mark.shard_id
            if not (
                0 <= shard.epoch < self.spec.epochs and 0 <= shard.index < self.spec.num_shards
            ):
                raise InvalidSpecError(f"mark of {self.spec.name!r}: {shard} does not exist")
            length = len(self._shard(shard, 0, 0))
            if not 0 <= mark.offset <= length:
                raise InvalidSpecError(
                    f"mark of {shard} in {self.spec.name!r}: offset {mark.offset} is outside "
                    f"0..{length}"
                )
        if mark.begin < 0 or mark.epoch < 0:
            raise InvalidSpecError(f"mark of {self.spec.name!r}: negative epoch or begin {mark}")
        self.ledgers.record(worker_id, mark.epoch, mark.begin, mark.shard_id, mark.offset, length)

    def renew(self, worker_id: str, now: float) -> int:
        """Extend every lease ``worker_id`` holds to ``now + lease_s``; returns how many."""
        return self.leases.renew(worker_id, now + self.spec.lease_s)

    # --- failures -------------------------------------------------------------------------
    def recover_worker(self, worker_id: str) -> list[ShardId]:
        """Put every shard `worker_id` holds back at the head of the todo queue (at-most-once:
        drop them, counting what was not reported trained as lost)."""
        self.ledgers.forget_worker(worker_id)
        return self._requeue(sorted(self.leases.held_by(worker_id)), f"worker {worker_id} lost")

    def expire(self, now: float) -> list[ShardId]:
        """Requeue every shard whose lease deadline is at or before ``now`` (at the head, with its
        offset in exactly-once mode) and forget its marks; returns those shards."""
        back = self._requeue(sorted(self.leases.expired(now)), "lease expired")
        self.ledgers.forget_shards(set(back))
        return back

    def _requeue(self, shard_ids: list[ShardId], reason: str) -> list[ShardId]:
        if self.spec.mode is DeliveryMode.AT_MOST_ONCE:
            return self._drop(shard_ids, reason)
        back: list[_Requeued] = []
        for shard_id in shard_ids:
            lease = self.leases.release(shard_id)
            if lease is None:
                continue
            attempt = lease.attempt + 1
            if attempt > self.spec.max_retries and self.failure is None:
                shard = self._shard(shard_id, 0, 0)
                self.failure = (
                    f"dataset {self.spec.name!r}: {shard_id} (samples "
                    f"[{shard.start}, {shard.end})) "
                    f"was handed out {attempt} times and lost each time (last: {reason}); "
                    f"max_retries={self.spec.max_retries}. Look at the logs of worker "
                    f"{lease.worker_id!r}, or register the dataset with a larger max_retries."
                )
                logger.error(self.failure)
            offset = lease.offset if self.spec.mode is DeliveryMode.EXACTLY_ONCE else 0
            back.append((shard_id.epoch, shard_id.index, offset, attempt))
            logger.info("%s of %r back to the queue head (%s)", shard_id, self.spec.name, reason)
        # extendleft reverses, so feed it reversed to keep the shards in order at the head.
        self.requeued.extendleft(reversed(back))
        return [ShardId(entry[0], entry[1]) for entry in back]

    def _drop(self, shard_ids: list[ShardId], reason: str) -> list[ShardId]:
        """At-most-once: release these leases for good; the samples past each one's reported
        progress are lost, and counted."""
        dropped: list[ShardId] = []
        for shard_id in shard_ids:
            lease = self.leases.release(shard_id)
            if lease is None:
                continue
            lost = len(self._shard(shard_id, 0, 0)) - lease.offset
            self.lost_shards += 1
            self.lost_samples += lost
            self.dropped[shard_id] = lost
            dropped.append(shard_id)
            logger.warning(
                "dataset %r (at-most-once): %s lost with %d samples not trained (%s; worker %s); "
                "%d samples lost so far",
                self.spec.name,
                shard_id,
                lost,
                reason,
                lease.worker_id,
                self.lost_samples,
            )
        return dropped

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise ShardRetriesExhaustedError(self.failure)

    # --- position (checkpoint / restore) --------------------------------------------------
    def position(self) -> Position:
        """The consumed position in canonical form, so equal consumption gives equal positions."""
        return self._canonical(self._pending_now())

    def position_at(self, epoch: int, consumed: int) -> PositionAt:
        """The position when every worker had consumed `consumed` samples of iteration `epoch`
        (a checkpoint at that step), from the workers' marks: shards they finished since are
        not done in it, and shards they were reading are pending at that step's offset."""
        if epoch < 0 or consumed < 0:
            raise InvalidSpecError(
                f"position of {self.spec.name!r} at epoch {epoch}, {consumed} samples: "
                f"both must be >= 0"
            )
        marked, waiting = self.ledgers.at(epoch, consumed)
        if waiting:
            return PositionAt(None, tuple(waiting))
        exact = self.spec.mode is DeliveryMode.EXACTLY_ONCE
        pending = self._pending_now()
        for shard_id, (used, end) in marked.items():
            key = (shard_id.epoch, shard_id.index)
            if used >= end:
                pending.pop(key, None)
            else:
                pending[key] = used if exact else 0
        return PositionAt(self._canonical(pending))

    def _pending_now(self) -> dict[tuple[int, int], int]:
        exact = self.spec.mode is DeliveryMode.EXACTLY_ONCE
        pending = {(e, i): (o if exact else 0) for e, i, o, _ in self.requeued}
        for shard_id, lease in self.leases.items():
            pending[(shard_id.epoch, shard_id.index)] = lease.offset if exact else 0
        return pending

    def _canonical(self, pending: dict[tuple[int, int], int]) -> Position:
        epoch, cursor = self.epoch, self.cursor
        # Untouched shards just behind the cursor belong to the todo part: move the cursor
        # back over them (across epoch starts too) so racing fetches do not change the form.
        while True:
            if cursor == 0:
                if epoch == 0:
                    break
                epoch, cursor = epoch - 1, self.spec.num_shards
                continue
            key = (epoch, self._index_at(epoch, cursor - 1))
            if pending.get(key, -1) != 0:
                break
            del pending[key]
            cursor -= 1
        entries = tuple(sorted((e, i, o) for (e, i), o in pending.items()))
        return Position(self.spec.name, epoch, cursor, entries)

    def restore(self, position: Position, token: str | None) -> bool:
        """Reset the queues to `position`; a repeat of the last applied `token` is a no-op. At
        most once, nothing is reset (False): the queue goes on where it is, since going back to
        the checkpoint's position would hand out again what was handed out since."""
        self._check_position(position)
        if token is not None and token == self.restore_token:
            return False
        if self.spec.mode is DeliveryMode.AT_MOST_ONCE:
            self._restore_at_most_once(position, token)
            return True
        self.epoch, self.cursor = position.epoch, position.cursor
        self.requeued = deque((e, i, o, 0) for e, i, o in sorted(position.pending))
        self.leases.clear()
        self.ledgers.clear()
        self.failure = None
        self.restore_token = token
        logger.info("dataset %r restored to %s", self.spec.name, position)
        return True

    def _restore_at_most_once(self, position: Position, token: str | None) -> None:
        """Go on from here, not from ``position``: the samples it had not trained that were
        handed out since are lost (the restored model never trains them), in place of what
        the drops since the last restore counted of them; the leases go (their readers
        restarted)."""
        after = (position.epoch, position.cursor)
        pending = {ShardId(e, i): o for e, i, o in position.pending}
        for shard_id, counted in self.dropped.items():
            if shard_id in pending or self._order(shard_id) >= after:
                self.lost_samples -= counted
        lost = sum(len(self._shard(shard_id, 0, 0)) - o for shard_id, o in pending.items())
        lost += self._samples_between(after, (self.epoch, self.cursor))
        self.lost_samples += lost
        self.dropped = {}
        self.leases.clear()
        self.ledgers.clear()
        self.failure = None
        self.restore_token = token
        logger.warning(
            "dataset %r is at-most-once: not going back to the checkpoint's position; %d "
            "samples it had not trained were handed out since and are lost (%d lost so far)",
            self.spec.name,
            lost,
            self.lost_samples,
        )

    def _order(self, shard_id: ShardId) -> tuple[int, int]:
        """(epoch, ordinal): where the shard comes in the hand-out order."""
        return (shard_id.epoch, self.spec.shard_ordinal(shard_id.epoch, shard_id.index))

    def _samples_between(self, begin: tuple[int, int], end: tuple[int, int]) -> int:
        """The samples of the shards handed out from (epoch, cursor) ``begin`` to ``end``."""
        spec, total = self.spec, 0
        last = spec.num_shards - 1
        for epoch in range(begin[0], end[0] + 1):
            low = begin[1] if epoch == begin[0] else 0
            high = end[1] if epoch == end[0] else spec.num_shards
            if high <= low:
                continue
            total += (high - low) * spec.samples_per_shard
            if low <= spec.shard_ordinal(epoch, last) < high:  # the short last shard
                total -= spec.samples_per_shard - spec.shard_length(last)
        return total

    def _check_position(self, position: Position) -> None:
        spec = self.spec
        problem = ""
        if position.dataset != spec.name:
            problem = f"it belongs to dataset {position.dataset!r}"
        elif not 0 <= position.epoch < spec.epochs:
            problem = f"epoch {position.epoch} is outside 0..{spec.epochs - 1}"
        elif not 0 <= position.cursor <= spec.num_shards:
            problem = f"cursor {position.cursor} is outside 0..{spec.num_shards}"
        for epoch, index, offset in position.pending:
            if problem:
                break
            if not (0 <= epoch <= position.epoch and 0 <= index < spec.num_shards):
                problem = f"pending shard [{epoch}, {index}] does not exist"
            elif not 0 <= offset <= len(self._shard(ShardId(epoch, index), 0, 0)):
                problem = f"pending shard [{epoch}, {index}] has offset {offset} > its length"
        if problem:
            raise InvalidPositionError(
                f"cannot restore dataset {spec.name!r}: {problem}. Restore a position taken "
                f"from this dataset with the same size, shard size and epochs."
            )

    def progress(self) -> DatasetProgress:
        """Counters for logs, metrics and tests (see DatasetProgress)."""
        todo = len(self.requeued) + max(0, self.spec.num_shards - self.cursor)
        return DatasetProgress(
            self.spec.name,
            self.epoch,
            todo,
            len(self.leases),
            self.done_shards,
            self.finished,
            self.lost_shards,
            self.lost_samples,
        )

    # --- state ----------------------------------------------------------------------------
    def to_state(self, leases: bool = True) -> dict[str, Any]:
        """JSON-able state for the master's store: spec, epoch, cursor, requeued shards and
        leases (``leases`` False: without them, which the store keeps apart, see
        `lease_changes`); the consumption marks are not kept."""
        state = {
            "spec": self.spec.to_dict(),
            "epoch": self.epoch,
            "cursor": self.cursor,
            "requeued": [list(entry) for entry in self.requeued],
            "done_shards": self.done_shards,
            "failure": self.failure,
            "restore_token": self.restore_token,
            "lost": [self.lost_shards, self.lost_samples],
            "dropped": [[k.epoch, k.index, n] for k, n in self.dropped.items()],
        }
        if leases:
            state["leases"] = [
                [k.epoch, k.index, lease.worker_id, lease.offset, lease.attempt]
                for k, lease in self.leases.items()
            ]
        return state

    def lease_changes(self) -> dict[tuple[int, int], list[Any] | None]:
        """The leases granted, released or moved on since they were last saved
        (`LeaseTable.changes_saved`), by (epoch, index): each as `to_state` lists it, None where
        released; empty until `leases.track()`. What the store writes of them is what changed,
        not the whole table (a call costs its change, however many shards are in flight)."""
        return {
            (k.epoch, k.index): (
                None
                if lease is None
                else [k.epoch, k.index, lease.worker_id, lease.offset, lease.attempt]
            )
            for k, lease in self.leases.changes().items()
        }

    @classmethod
    def from_state(cls, state: dict[str, Any], now: float) -> DatasetQueue:
        """Rebuild from to_state(); leases restart their full lease time from `now`."""
        queue = cls(DatasetSpec.from_dict(state["spec"]))
        queue.epoch, queue.cursor = int(state["epoch"]), int(state["cursor"])
        queue.requeued = deque((int(e), int(i), int(o), int(a)) for e, i, o, a in state["requeued"])
        for epoch, index, worker_id, offset, attempt in state.get("leases", ()):
            lease = Lease(str(worker_id), now + queue.spec.lease_s, int(attempt), int(offset))
            queue.leases.grant(ShardId(int(epoch), int(index)), lease)
        queue.done_shards = int(state["done_shards"])
        queue.failure = state["failure"]
        queue.restore_token = state["restore_token"]
        queue.lost_shards, queue.lost_samples = (int(n) for n in state.get("lost", (0, 0)))
        queue.dropped = {ShardId(int(e), int(i)): int(n) for e, i, n in state.get("dropped", [])}
        return queue
