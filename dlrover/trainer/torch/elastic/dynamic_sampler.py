"""DynamicShardSampler: a DataLoader sampler that leases its samples from the job master in shards."""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from dlrover.client.sharding_client import ShardingClient
from dlrover.client.sharding_transport import ShardingTransport
from dlrover.sharding.errors import InvalidPositionError
from dlrover.sharding.types import ConsumptionMark, DatasetSpec, DeliveryMode, Position, Shard
from dlrover.trainer.torch.elastic.client_factory import (
    default_worker_id,
    lease_s_from_env,
    prefetch_from_env,
    restore_token,
    transport_from_env,
)
from dlrover.worker_context import WorkerContext

logger = logging.getLogger(__name__)


@dataclass
class _Yielded:
    """A shard the iterator has started: its samples occupy [begin, begin + count) of the
    samples yielded in this iteration."""

    shard: Shard
    begin: int
    count: int


class DynamicShardSampler(Sampler[int]):
    """A DataLoader sampler whose split of the dataset survives workers coming and going.

    Dynamic mode (a `client` or `transport` is given, or DLROVER_MASTER_ADDR names a master):
    indices come from shards leased from the master, so a fast worker reads more and a lost
    worker's shards go to others. One iteration is one epoch of the registered dataset
    (`num_epochs` are registered); ranks may get different numbers of samples, so synchronous
    DDP loops must use torch's `Join` context (or static mode). A shard is reported done once
    its samples are consumed: exactly, when `ElasticDataLoader` drives the sampler (it calls
    `mark_consumed`) or when `state_dict(step, ...)` is called; otherwise (plain DataLoader)
    one shard behind what was yielded, and everything when the iteration ends.

    Static mode (no master): like DistributedSampler over RANK / WORLD_SIZE; `state_dict`
    records how many samples of the epoch the whole job consumed, and `load_state_dict`
    splits the rest among the current (possibly different) number of ranks.
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
        client: ShardingClient | None = None,
        transport: ShardingTransport | None = None,
        dataset_name: str | None = None,
        shard_size: int = 0,
        num_epochs: int = 1,
        mode: DeliveryMode = DeliveryMode.AT_LEAST_ONCE,
        worker_id: str | None = None,
    ) -> None:
        self.dataset_size = len(dataset)
        self.num_replicas = num_replicas if num_replicas is not None else _world_size()
        self.rank = rank if rank is not None else _rank()
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank {self.rank} is outside 0..{self.num_replicas - 1}")
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.epoch = 0
        self.completed_num = 0
        if client is None:
            transport = transport if transport is not None else transport_from_env()
            if transport is not None:
                spec = DatasetSpec(
                    name=dataset_name or f"{type(dataset).__name__}-{self.dataset_size}",
                    size=self.dataset_size,
                    shard_size=shard_size or self._default_shard_size(),
                    epochs=num_epochs,
                    shuffle=shuffle,
                    seed=seed,
                    mode=mode,
                    lease_s=lease_s_from_env(),
                )
                client = ShardingClient(
                    transport,
                    spec,
                    worker_id or default_worker_id(self.rank),
                    prefetch=prefetch_from_env(),
                )
        self.client = client
        self._started = False
        self._ledger: deque[_Yielded] = deque()
        self._stash: Shard | None = None
        self._yielded = 0
        self._consumed = 0
        self._consumer_driven = False

    @property
    def dynamic(self) -> bool:
        """True when shards come from the master through a sharding client; False for the static
        split by rank."""
        return self.client is not None

    def _default_shard_size(self) -> int:
        # At least ~8 shards per worker, so a fast worker can take over a slow one's share.
        return max(1, min(1024, math.ceil(self.dataset_size / (8 * self.num_replicas))))

    # --- torch Sampler --------------------------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        if self.client is None:
            return self._static_indices()
        return self._dynamic_indices(self.client)

    def __len__(self) -> int:
        """Exact in static mode; in dynamic mode an even share, as the split is not known ahead."""
        remaining = self.dataset_size - (0 if self.dynamic else self.completed_num)
        if self.drop_last and not self.dynamic:
            return remaining // self.num_replicas
        return math.ceil(remaining / self.num_replicas)

    def set_epoch(self, epoch: int) -> None:
        """Static mode: choose the epoch's shuffle. Dynamic mode: the master tracks epochs."""
        if epoch != self.epoch:
            self.completed_num = 0
        self.epoch = epoch

    # --- static mode ----------------------------------------------------------------------
    def _static_indices(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_size, generator=generator).tolist()
        else:
            order = list(range(self.dataset_size))
        remaining = order[self.completed_num :]
        if self.drop_last:
            remaining = remaining[: len(remaining) - len(remaining) % self.num_replicas]
        elif remaining and len(remaining) % self.num_replicas:
            padding = self.num_replicas - len(remaining) % self.num_replicas
            remaining += (remaining * math.ceil(padding / len(remaining)))[:padding]
        return iter(remaining[self.rank :: self.num_replicas])

    # --- dynamic mode ---------------------------------------------------------------------
    def _dynamic_indices(self, client: ShardingClient) -> Iterator[int]:
        if not self._started:
            client.start()
            self._started = True
        self._settle(self._yielded)  # a new iteration: everything before it was consumed
        self._ledger.clear()
        self._yielded = self._consumed = 0
        epoch: int | None = None
        while True:
            shard = self._stash
            if shard is None:
                shard = client.next_shard(until_drained=True)
            self._stash = None
            if shard is None:
                break
            if epoch is None:
                epoch = shard.id.epoch
                self.epoch = epoch
            elif shard.id.epoch > epoch:
                self._stash = shard  # the next epoch starts with the next iteration
                break
            self._ledger.append(_Yielded(shard, self._yielded, len(shard) - shard.offset))
            # Before the shard's first sample: state_dict(step) on any rank finds every rank's
            # place in the master (this rank's samples of step s were yielded before step s).
            client.mark(ConsumptionMark(epoch, self._yielded, shard.id, shard.offset))
            for index in shard.indices():
                self._yielded += 1
                client.touch()
                yield index
                if not self._consumer_driven:
                    self._settle(self._yielded - len(shard))
        if not self._consumer_driven:
            self._settle(self._yielded)
        if epoch is not None:
            client.mark(ConsumptionMark(epoch, self._yielded))  # this iteration has ended

    def attach_consumer(self) -> None:
        """Called by ElasticDataLoader: consumption is reported by `mark_consumed` from now on."""
        self._consumer_driven = True

    def mark_consumed(self, num_samples: int) -> None:
        """`num_samples` more samples of this iteration were trained (by this rank)."""
        self._settle(min(self._yielded, self._consumed + num_samples))

    def _settle(self, consumed: int) -> None:
        """Report done every shard whose samples all lie below `consumed`."""
        self._consumed = max(self._consumed, consumed)
        if self.client is None:
            return
        while self._ledger and self._ledger[0].begin + self._ledger[0].count <= self._consumed:
            self.client.report_done(self._ledger.popleft().shard)

    # --- checkpoint -----------------------------------------------------------------------
    def state_dict(self, step: int, micro_batch_size: int) -> dict[str, Any]:
        """Where to resume: every rank trained `step` micro-batches of `micro_batch_size` in the
        current iteration (epoch). Call it on any ranks: rank 0 alone (the usual
        `if rank == 0: torch.save(...)`) or every rank. It runs no collective; in dynamic mode
        the master computes the position at that step from where each rank reported each of
        its shards to begin (a bounded wait only if a rank has not got that far yet)."""
        consumed = step * micro_batch_size
        if self.client is None:
            return {
                "mode": "static",
                "epoch": self.epoch,
                "completed_num": self.completed_num + consumed * self.num_replicas,
                "dataset_size": self.dataset_size,
            }
        self._settle(min(consumed, self._yielded))
        if self._ledger and self.client.spec.mode is DeliveryMode.EXACTLY_ONCE:
            head = self._ledger[0]
            done_in_shard = head.shard.offset + max(0, self._consumed - head.begin)
            self.client.report_progress(head.shard, done_in_shard)
        position = self.client.position_at(self.epoch, consumed)
        return {"mode": "dynamic", "position": position.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from `state_dict()`. In dynamic mode every rank may call it: the master applies
        one checkpoint's position once per restart (keyed by the position and restart count)."""
        if state.get("mode") == "static":
            if self.client is not None:
                raise InvalidPositionError(
                    "this checkpoint was taken with static sharding but the sampler now uses "
                    "dynamic shards from the master; restore it without DLROVER_MASTER_ADDR"
                )
            if int(state["dataset_size"]) != self.dataset_size:
                raise InvalidPositionError(
                    f"checkpoint is of a dataset of {state['dataset_size']} samples, this one has "
                    f"{self.dataset_size}"
                )
            self.epoch = int(state["epoch"])
            self.completed_num = int(state["completed_num"])
            return
        if self.client is None:
            raise InvalidPositionError(
                "this checkpoint holds a dynamic-shard position but no sharding master is "
                "configured (set DLROVER_MASTER_ADDR or pass client=/transport=)"
            )
        position = Position.from_dict(state["position"])
        if not self._started:
            self.client.transport.register_dataset(self.client.spec)
        self.client.restore_position(position, restore_token(position.to_dict()))
        self._ledger.clear()
        self._stash = None
        self._yielded = self._consumed = 0

    def close(self) -> None:
        """Stop the sharding client's prefetcher; nothing in static mode."""
        if self.client is not None:
            self.client.close()


def _world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return WorkerContext.from_env().world_size


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return WorkerContext.from_env().rank
