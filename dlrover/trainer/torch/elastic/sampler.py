"""ElasticDistributedSampler: DistributedSampler that checkpoints its place in an epoch and resumes
it at any world size (DLRover's semantics; dynamic shards are DynamicShardSampler's)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from dlrover.trainer.torch.elastic import placement

logger = logging.getLogger(__name__)


class ElasticDistributedSampler(DistributedSampler):  # type: ignore[type-arg]
    """A ``DistributedSampler`` whose place in the epoch goes into a checkpoint.

    Every rank gets the same number of samples every epoch (padded, or cut with
    ``drop_last``, as ``DistributedSampler`` does), so synchronous DDP loops stay in lockstep.
    ``state_dict(step, micro_batch_size)`` records ``step x micro_batch_size x num_replicas``
    samples of the epoch as trained; ``load_state_dict`` splits the rest of that epoch among
    the ranks of the job now, however many there are. Nothing is asked of the job master, so a
    checkpoint moves freely between torchrun and dlrover-run.

    ``step`` may count the steps of the current epoch or, as DLRover's examples do, all steps
    since training began: a count past the epoch's end is taken modulo the dataset size, as
    DLRover does (exact when the job ran at one world size with full batches).

    Without a process group, ``num_replicas`` and ``rank`` come from WORLD_SIZE and RANK (1 and
    0 when unset), so the sampler can be built before ``init_process_group``.
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        num_replicas = placement.world_size() if num_replicas is None else num_replicas
        rank = placement.rank() if rank is None else rank
        super().__init__(
            dataset,  # type: ignore[arg-type]
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.completed_num = 0
        """Samples of epoch ``self.epoch`` trained before this iteration (from a checkpoint)."""
        self._resume_epoch: int | None = None
        self._set_num_samples()

    @property
    def dataset_size(self) -> int:
        """Samples in the dataset."""
        return len(self.dataset)  # type: ignore[arg-type]

    def _completed(self) -> int:
        """Samples of the current epoch already trained: the resumed place, in its own epoch."""
        return self.completed_num if self._resume_epoch == self.epoch else 0

    def _epoch_order(self) -> list[int]:
        """The whole epoch's indices, padded to a multiple of ``num_replicas`` (with
        ``drop_last``: not yet cut): the order a failure-free epoch at this world size trains,
        rank r taking every r-th."""
        size = self.dataset_size
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order: list[int] = torch.randperm(size, generator=generator).tolist()
        else:
            order = list(range(size))
        if self.drop_last:
            return order  # cut after the trained part is taken off (see _remaining)
        return _pad(order, self.num_replicas)

    def _remaining(self, completed: int) -> list[int]:
        if completed >= self.dataset_size:
            return []
        rest = self._epoch_order()[completed:]
        if self.drop_last:
            return rest[: len(rest) - len(rest) % self.num_replicas]
        # After a resume at another world size the rest may not divide; pad it again.
        return _pad(rest, self.num_replicas)

    def _remaining_count(self, completed: int) -> int:
        size = self.dataset_size
        if completed >= size:
            return 0
        if self.drop_last:
            rest = size - completed
            return rest - rest % self.num_replicas
        return _padded_length(
            _padded_length(size, self.num_replicas) - completed, self.num_replicas
        )

    def _set_num_samples(self) -> None:
        self.num_samples = self._remaining_count(self._completed()) // self.num_replicas
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        self._set_num_samples()
        resumed = self._resume_epoch == self.epoch
        indices = self._remaining(self._completed())
        assert len(indices) == self.total_size, (len(indices), self.total_size)
        mine = indices[self.rank : self.total_size : self.num_replicas]
        return self._yield(mine, resumed)

    def _yield(self, indices: list[int], resumed: bool) -> Iterator[int]:
        yield from indices
        if resumed and self._resume_epoch == self.epoch:
            # The resumed place is used up: the same epoch iterated again (a loop that does
            # not call set_epoch) is whole again, as in a failure-free run.
            self._resume_epoch = None
            self.completed_num = 0

    def __len__(self) -> int:
        self._set_num_samples()
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch's shuffle; a resumed place applies only to its own epoch."""
        self.epoch = epoch

    def state_dict(
        self, iter_step: int | None = None, micro_batch_size: int = 1, *, step: int | None = None
    ) -> dict[str, Any]:
        """Where to resume, by DLRover's rule: every rank trained ``iter_step`` batches of
        ``micro_batch_size`` samples, counted in this epoch or since training began (DLRover's
        examples; after a resume, counting on from the loaded step). Runs no collective and asks
        nobody: call it on rank 0 alone or on every rank. DLRover's keys (``completed_num``,
        ``epoch``) plus ``dataset_size``, ``num_replicas`` and ``micro_batch_size``, which make
        a count since training began exact whatever the dataset size. ``step=`` is accepted
        for ``iter_step=`` (the name this method had here before)."""
        if iter_step is None:
            if step is None:
                raise TypeError("state_dict() needs iter_step (the steps trained)")
            iter_step = step
        return {
            "completed_num": iter_step * micro_batch_size * self.num_replicas,
            "epoch": self.epoch,
            "dataset_size": self.dataset_size,
            "num_replicas": self.num_replicas,
            "micro_batch_size": micro_batch_size,
        }

    def state_after(self, samples_this_iteration: int) -> dict[str, Any]:
        """``state_dict`` for a caller that counts the samples each rank trained in this
        iteration (ElasticDataLoader): the resumed place, if any, is added."""
        completed = self._completed() + samples_this_iteration * self.num_replicas
        return {
            "completed_num": completed,
            "epoch": self.epoch,
            "dataset_size": self.dataset_size,
            "num_replicas": self.num_replicas,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()`` (ours or DLRover's): the next iteration of that epoch
        trains the samples not yet trained, split among this job's ranks."""
        if "position" in state or state.get("mode") == "dynamic":
            raise ValueError(
                "this sampler state holds a position of dynamic shards from the job master; "
                "load it into DynamicShardSampler, which saved it"
            )
        saved_size = state.get("dataset_size")
        if saved_size is not None and int(saved_size) != self.dataset_size:
            raise ValueError(
                f"the checkpoint's sampler state is of a dataset of {saved_size} samples, this "
                f"dataset has {self.dataset_size}; resume with the same dataset"
            )
        epoch = int(state.get("epoch", 0))
        completed = _epoch_place(
            int(state.get("completed_num", 0)),
            self.dataset_size,
            int(state.get("num_replicas", self.num_replicas)),
            int(state.get("micro_batch_size", 0)),
        )
        self.epoch = epoch
        self.completed_num = completed
        self._resume_epoch = epoch
        self._set_num_samples()
        logger.info(
            "resuming epoch %d after %d of %d samples: %d per rank left",
            epoch,
            completed,
            self.dataset_size,
            self.num_samples,
        )


def _epoch_place(completed: int, size: int, world: int, micro_batch_size: int) -> int:
    """Samples of its epoch a saved ``completed_num`` means (``size`` or more: all of them).

    A count past one epoch was taken over every step since training began. With the micro-batch
    size saved, an epoch is the whole batches a rank ran through it (a short last batch counts
    whole, as the step count does); DLRover's states lack it, so the dataset size stands in
    (exact when the dataset divides into whole global batches)."""
    if size <= 0 or completed <= 0:
        return 0
    per_rank = -(-size // world) if world > 0 else size
    if micro_batch_size > 0:
        epoch_units = -(-per_rank // micro_batch_size) * micro_batch_size * world
    else:
        epoch_units = _padded_length(size, world)
    if completed > epoch_units:
        period = epoch_units if micro_batch_size > 0 else size
        completed = (completed - 1) % period + 1  # an exact multiple: that epoch is done
    return min(completed, size)  # size or more: the epoch is done


def _padded_length(length: int, multiple: int) -> int:
    return math.ceil(length / multiple) * multiple if multiple > 0 else length


def _pad(order: list[int], multiple: int) -> list[int]:
    """``order`` extended with its own head to a multiple of ``multiple`` (as DistributedSampler
    pads)."""
    missing = _padded_length(len(order), multiple) - len(order)
    if missing <= 0 or not order:
        return order
    return order + (order * math.ceil(missing / len(order)))[:missing]
