"""DynamicShardSampler: DataLoader indices leased from the job master in shards, every rank the
same number per epoch."""

from __future__ import annotations

import logging
import math
import re
from collections import deque
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any

from torch.utils.data import Sampler

from dlrover import worker_context
from dlrover.client.sharding_client import ShardingClient
from dlrover.client.sharding_transport import ShardingTransport
from dlrover.constants import ENV_MASTER_ADDR
from dlrover.sharding.errors import DatasetConflictError, InvalidPositionError, InvalidSpecError
from dlrover.sharding.lockstep import LockstepError, LockstepQuota, lockstep_quota
from dlrover.sharding.types import ConsumptionMark, DatasetSpec, DeliveryMode, Position, Shard
from dlrover.trainer.torch.elastic import placement
from dlrover.trainer.torch.elastic.client_factory import (
    NoMasterError,
    attempt_id,
    default_worker_id,
    delivery_mode,
    lease_s_from_env,
    prefetch_from_env,
    restore_token,
    transport_from_env,
)

logger = logging.getLogger(__name__)

MAX_DEFAULT_SHARD_SIZE = 512
"""The default shard size is the dataset size / DEFAULT_SHARDS_PER_EPOCH, at most this."""
DEFAULT_SHARDS_PER_EPOCH = 2048
"""Shards per epoch aimed at by the default shard size: many, so that the padding to the
lockstep quota (at most about one shard per rank) stays small."""


@dataclass
class _Yielded:
    """A shard the iterator has started: its samples occupy [begin, begin + count) of the
    samples yielded in this iteration."""

    shard: Shard
    begin: int
    count: int


class DynamicShardSampler(Sampler[int]):
    """Indices leased shard by shard from the DLRover job master: an explicit opt-in that needs
    the master (run under dlrover-run, or pass ``transport=``); without one, use
    ElasticDistributedSampler.

    A lost worker's shards go back to the master's queue, and the place in the epoch (shards
    done, and how far into each with ``mode="exactly-once"``) goes into a checkpoint through
    ``state_dict`` and is restored at any world size.

    Lockstep: every rank yields exactly ``len(self)`` indices per epoch, so a synchronous loop
    (DDP without ``Join``) never waits on a rank that ran out. Each rank leases at most its
    quota of shards (dlrover.sharding.lockstep: ceil(shards left / world size), floor with
    ``drop_last``, computed alike on every rank from the spec, the world size and the restored
    position); a rank whose shards ran out pads with repeats of its own samples, as
    DistributedSampler pads, and repeats are never reported as trained. Ranks that would
    disagree on the count (not built alike, or not all restored) raise LockstepError.

    Epochs: ``set_epoch(e)`` picks epoch e, which is its own dataset on the master
    (``<dataset_name>/epoch-<e>``, registered when first read, shuffled with ``seed + e``);
    without ``set_epoch``, each completed iteration moves on to the next epoch. Every epoch the
    loop asks for is trained unless ``num_epochs`` bounds them.

    A shard is reported done once its samples are consumed: exactly, when ElasticDataLoader
    drives the sampler (it calls ``mark_consumed``) or when ``state_dict(step, ...)`` is
    called; otherwise (plain DataLoader) one shard behind what was yielded, and everything
    when the iteration ends.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        transport: ShardingTransport | None = None,
        dataset_name: str | None = None,
        shard_size: int = 0,
        num_epochs: int | None = None,
        mode: DeliveryMode | str | None = None,
        worker_id: str | None = None,
        prefetch: int | None = None,
    ) -> None:
        transport = transport if transport is not None else transport_from_env()
        if transport is None:
            raise NoMasterError(
                f"DynamicShardSampler leases its shards from the DLRover job master, and none is "
                f"configured ({ENV_MASTER_ADDR} is not set): run the script under dlrover-run, "
                f"or pass transport=. Without a master, use ElasticDistributedSampler (static, "
                f"resumable, the same number of samples on every rank)."
            )
        self.transport = transport
        self.dataset_size = len(dataset)
        self.num_replicas = num_replicas if num_replicas is not None else placement.world_size()
        self.rank = rank if rank is not None else placement.rank()
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is outside 0..{self.num_replicas - 1}")
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 (or None: no bound), got {num_epochs}")
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.num_epochs = num_epochs
        self.mode = delivery_mode(mode, DeliveryMode.AT_LEAST_ONCE)
        if self.mode is DeliveryMode.AT_MOST_ONCE:
            raise InvalidSpecError(
                "DynamicShardSampler keeps every rank's batch count equal, by repeating samples "
                "where shards run out; after a loss under at-most-once it would have to repeat "
                "some. Use at-least-once or exactly-once here; for at-most-once read the "
                "dataset with dlrover.client.sharding_client.ShardingClient (each worker its "
                "own pace) or a stream with ElasticStreamDataset(mode='at-most-once')"
            )
        self.dataset_name = dataset_name or f"{type(dataset).__name__}-{self.dataset_size}"
        # Independent of the world size: a restart at another size re-registers the same spec.
        self.shard_size = shard_size or max(
            1, min(MAX_DEFAULT_SHARD_SIZE, math.ceil(self.dataset_size / DEFAULT_SHARDS_PER_EPOCH))
        )
        self.worker_id = worker_id or default_worker_id(self.rank)
        self.prefetch = prefetch if prefetch is not None else prefetch_from_env()
        self.lease_s = lease_s_from_env()
        self.epoch = 0
        self._advance = False
        """Set when an iteration completes: the next one reads the next epoch (no set_epoch)."""
        self._restored: tuple[int, Position] | None = None
        self._restore_used = False
        """The restored epoch has completed an iteration: the restored place is spent."""
        self._prepared: set[int] = set()
        self._iterations: dict[int, int] = {}
        self._client: ShardingClient | None = None
        self._client_epoch = -1
        self._iteration_quota: LockstepQuota | None = None
        self._ledger: deque[_Yielded] = deque()
        self._yielded = 0
        self._consumed = 0
        self._consumer_driven = False

    # --- epochs and quotas ----------------------------------------------------------------
    def epoch_spec(self, epoch: int) -> DatasetSpec:
        """The master's dataset of one epoch: ``<dataset_name>/epoch-<epoch>``."""
        return DatasetSpec(
            name=f"{self.dataset_name}/epoch-{epoch}",
            size=self.dataset_size,
            shard_size=self.shard_size,
            shuffle=self.shuffle,
            seed=self.seed + epoch,
            mode=self.mode,
            lease_s=self.lease_s,
        )

    def quota(self, epoch: int | None = None) -> LockstepQuota:
        """What every rank reads in the next iteration of ``epoch`` (default: the one the next
        iteration reads): the rest of a restored epoch, else the whole epoch."""
        epoch = self._next_epoch() if epoch is None else epoch
        position = None
        if self._restored is not None and self._restored[0] == epoch and not self._restore_used:
            position = self._restored[1]
        return lockstep_quota(self.epoch_spec(epoch), self.num_replicas, self.drop_last, position)

    def _next_epoch(self) -> int:
        return self.epoch + 1 if self._advance else self.epoch

    def _check_epoch(self, epoch: int) -> None:
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if self.num_epochs is not None and epoch >= self.num_epochs:
            raise ValueError(
                f"DynamicShardSampler was built with num_epochs={self.num_epochs}; epoch {epoch} "
                f"is past the last one ({self.num_epochs - 1}). Pass a larger num_epochs, or "
                f"None to read every epoch the loop asks for."
            )
        if self._restored is not None and epoch < self._restored[0]:
            raise ValueError(
                f"the sampler was restored at epoch {self._restored[0]} (load_state_dict); epoch "
                f"{epoch} was trained before that checkpoint. Resume the loop at epoch "
                f"{self._restored[0]} (the checkpoint's sampler state has it as 'epoch')."
            )

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` next (on every rank). ValueError for an epoch at or past
        ``num_epochs``, or before the epoch of the restored checkpoint."""
        self._check_epoch(epoch)
        if epoch != self.epoch or self._advance:
            self._iteration_quota = None
        self.epoch = epoch
        self._advance = False

    def __len__(self) -> int:
        """Exactly the number of indices the next (or the running) iteration yields, on every
        rank: the lockstep quota's samples."""
        if self._iteration_quota is not None and not self._advance:
            return self._iteration_quota.samples
        return self.quota().samples

    # --- iteration ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        if self._advance:
            self.epoch += 1
            self._advance = False
        epoch = self.epoch
        self._check_epoch(epoch)
        quota = self.quota(epoch)
        self._settle(self._yielded)  # a new iteration: everything before it was consumed
        self._close_client()
        self._iteration_quota = quota
        return self._indices(epoch, quota)

    def _indices(self, epoch: int, quota: LockstepQuota) -> Iterator[int]:
        spec = self._prepare(epoch)
        iteration = self._iterations[epoch] = self._iterations.get(epoch, -1) + 1
        self._agree(spec, iteration, quota)
        logger.info(
            "%s: rank %d reads up to %d of the %d shards left, %d samples with padding",
            spec.name,
            self.rank,
            quota.shards,
            quota.shards_left,
            quota.samples,
        )
        self._ledger.clear()
        self._yielded = self._consumed = 0
        client = ShardingClient(
            self.transport, spec, self.worker_id, prefetch=self.prefetch, max_shards=quota.shards
        )
        self._client, self._client_epoch = client, epoch
        real: list[int] = []
        try:
            if quota.shards:
                client.start()
                yield from self._leased_indices(client, quota, real)
                # The real samples end here: a position is never waited for past them.
                client.mark(ConsumptionMark(0, self._yielded))
            lag = self._ledger[-1].count if self._ledger else 0
            for index in self._padding(real, quota.samples - len(real)):
                self._yielded += 1
                client.touch()
                yield index
                if not self._consumer_driven:
                    self._settle(self._yielded - lag)
            if not self._consumer_driven:
                self._settle(self._yielded)
        finally:
            client.close()  # leases still held stay until reported, recovered or expired
        self._advance = True
        if self._restored is not None and self._restored[0] == epoch:
            self._restore_used = True

    def _leased_indices(
        self, client: ShardingClient, quota: LockstepQuota, real: list[int]
    ) -> Iterator[int]:
        """The samples of the shards this rank leases (at most ``quota.shards``), appended to
        ``real`` as they are yielded."""
        stopped = False
        while True:
            shard = client.next_shard(until_drained=True)
            if shard is None and not stopped:
                # Nothing to lease now: the rest is leased to other ranks, which read it within
                # their quota. Stop leasing, then read what a fetch in flight brought.
                client.stop_fetching()
                stopped = True
                shard = client.next_shard(until_drained=True)
            if shard is None:
                return
            count = len(shard) - shard.offset
            if self._yielded + count > quota.samples:
                raise LockstepError(
                    f"{client.spec.name}: rank {self.rank} got {shard.id} ({count} samples) "
                    f"after {self._yielded}, past its quota of {quota.samples}: the master's "
                    f"position is not the one this rank restored. Every rank must call "
                    f"load_state_dict with the same state."
                )
            self._ledger.append(_Yielded(shard, self._yielded, count))
            # Before the shard's first sample: state_dict(step) on any rank finds every rank's
            # place in the master (this rank's samples of step s came before it).
            client.mark(ConsumptionMark(0, self._yielded, shard.id, shard.offset))
            for index in shard.indices():
                self._yielded += 1
                real.append(index)
                client.touch()
                yield index
                if not self._consumer_driven:
                    self._settle(self._yielded - count)

    def _padding(self, real: list[int], count: int) -> list[int]:
        """``count`` repeats: of this rank's samples of the iteration, in order and again, or
        (a rank that got none) of every ``num_replicas``-th sample from its rank on."""
        if count <= 0:
            return []
        if real:
            return [real[i % len(real)] for i in range(count)]
        return [(self.rank + i * self.num_replicas) % self.dataset_size for i in range(count)]

    def _prepare(self, epoch: int) -> DatasetSpec:
        """Register the epoch's dataset (once per process); after a restore, an epoch past the
        restored one starts from its beginning: what the previous attempt read of it went into
        a model that the restore rolled back. The same, exactly-once, for a restarted start of
        the job that restored nothing: its model starts over (no checkpoint yet, or none that
        every node could load), so what earlier starts read went into a model that is gone."""
        spec = self.epoch_spec(epoch)
        if epoch in self._prepared:
            return spec
        self.transport.register_dataset(spec)
        if self._restored is not None and epoch > self._restored[0]:
            restored = self._restored[1].to_dict()
            token = restore_token({"from_start": spec.name, "after": restored})
            self.transport.restore_position(Position(spec.name, 0, 0), token)
        elif self._restored is None and self.mode is DeliveryMode.EXACTLY_ONCE and _restarted():
            token = restore_token({"from_start": spec.name, "after": None})
            self.transport.restore_position(Position(spec.name, 0, 0), token)
        self._prepared.add(epoch)
        return spec

    def _agree(self, spec: DatasetSpec, iteration: int, quota: LockstepQuota) -> None:
        """Raise LockstepError on a rank whose count differs from the one the first rank of this
        start of the job registered: a write-once record on the master (a dataset of that many
        samples, never read), so no collective is needed."""
        record = DatasetSpec(
            name=f"{spec.name}/lockstep/{attempt_id()}/{iteration}",
            size=quota.samples,
            shard_size=max(1, quota.samples),
        )
        try:
            self.transport.register_dataset(record)
        except DatasetConflictError as error:
            # The conflict names the registered spec first: its size is the first rank's count.
            first = re.search(r"size=(\d+)", str(error))
            theirs = first.group(1) if first else "another number"
            raise LockstepError(
                f"{spec.name}: the ranks disagree on how many samples each reads in this epoch: "
                f"rank {self.rank} would read {quota.samples}, the first rank {theirs}. "
                f"Build DynamicShardSampler with the same arguments on every rank, and call "
                f"load_state_dict with the same state on every rank, not on rank 0 alone."
            ) from None

    def attach_consumer(self) -> None:
        """Called by ElasticDataLoader: consumption is reported by `mark_consumed` from now on."""
        self._consumer_driven = True

    def mark_consumed(self, num_samples: int) -> None:
        """`num_samples` more samples of this iteration were trained (by this rank)."""
        self._settle(min(self._yielded, self._consumed + num_samples))

    def _settle(self, consumed: int) -> None:
        """Report done every shard whose samples all lie below `consumed`."""
        self._consumed = max(self._consumed, consumed)
        if self._client is None:
            return
        while self._ledger and self._ledger[0].begin + self._ledger[0].count <= self._consumed:
            self._client.report_done(self._ledger.popleft().shard)

    def _close_client(self) -> None:
        if self._client is not None:
            self._client.close()

    # --- checkpoint -----------------------------------------------------------------------
    def state_dict(self, step: int, micro_batch_size: int) -> dict[str, Any]:
        """Where to resume: every rank trained `step` micro-batches of `micro_batch_size` in the
        current iteration of the current epoch (since the restore, in a restored one). Call it
        on any ranks: rank 0 alone or every rank; it runs no collective. The master computes
        the position at that step from where each rank reported each of its shards to begin."""
        epoch = self.epoch
        limit = self._iteration_quota if self._client_epoch == epoch else None
        samples = (limit or self.quota(epoch)).samples
        # The last batch of a pass may be short: step x micro_batch_size may pass the count.
        if step < 0 or micro_batch_size < 1 or (step - 1) * micro_batch_size >= max(samples, 1):
            raise ValueError(
                f"state_dict(step={step}, micro_batch_size={micro_batch_size}): a rank reads "
                f"{samples} samples in this pass of epoch {epoch}, "
                f"{math.ceil(samples / max(micro_batch_size, 1))} batches; step counts the "
                f"micro-batches of the current pass, not of the whole run"
            )
        consumed = min(step * micro_batch_size, samples)
        spec = self._prepare(epoch)
        client = self._client if self._client_epoch == epoch else None
        if client is None:
            client = ShardingClient(self.transport, spec, self.worker_id)
        else:
            self._settle(min(consumed, self._yielded))
            if self._ledger and self.mode is DeliveryMode.EXACTLY_ONCE:
                head = self._ledger[0]
                done_in_shard = head.shard.offset + max(0, self._consumed - head.begin)
                client.report_progress(head.shard, done_in_shard)
        position = client.position_at(0, consumed)
        return {
            "mode": "dynamic",
            "epoch": epoch,
            "position": position.to_dict(),
            "num_replicas": self.num_replicas,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`: call it on every rank (the master applies one state once
        per start of the job; each rank needs it for its quota). The next iteration reads the
        rest of that epoch, split among this job's ranks; later epochs start from their
        beginning."""
        if state.get("mode") != "dynamic" or "position" not in state:
            raise InvalidPositionError(
                "this sampler state was saved by ElasticDistributedSampler (static sharding): "
                "load it into ElasticDistributedSampler, or start DynamicShardSampler without it"
            )
        if "epoch" not in state:
            raise InvalidPositionError(
                "this sampler state has no 'epoch': it was saved by an older sampler whose "
                "epochs were one dataset; DynamicShardSampler cannot resume it"
            )
        epoch = int(state["epoch"])
        position = Position.from_dict(state["position"])
        spec = self.epoch_spec(epoch)
        if position.dataset != spec.name:
            raise InvalidPositionError(
                f"the state is a position in dataset {position.dataset!r}, but this sampler "
                f"reads {spec.name!r} in epoch {epoch}: pass the dataset_name it was saved with"
            )
        if self.num_epochs is not None and epoch >= self.num_epochs:
            raise InvalidPositionError(
                f"the state is of epoch {epoch}, past num_epochs={self.num_epochs}"
            )
        self.transport.register_dataset(spec)
        self.transport.restore_position(position, restore_token(position.to_dict()))
        self._close_client()
        self._client, self._client_epoch, self._iteration_quota = None, -1, None
        self._ledger.clear()
        self._yielded = self._consumed = 0
        self._restored = (epoch, position)
        self._restore_used = False
        self._prepared = {epoch}  # epochs past it are reset when first read
        self.epoch = epoch
        self._advance = False

    def close(self) -> None:
        """Stop the sharding client's prefetcher."""
        self._close_client()


def _restarted() -> bool:
    """Whether these workers are a later start of the job (a restart, or a later rendezvous
    round), whose earlier starts may have read shards."""
    ctx = worker_context.WorkerContext.from_env()
    return ctx.restart_count > 0 or ctx.rdzv_round > 1
