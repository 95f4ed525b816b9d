"""ElasticTrainer: keeps the global batch size fixed as the number of workers changes."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from dlrover.worker_context import WorkerContext

logger = logging.getLogger(__name__)


def accumulation_steps(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Micro-batches per rank per optimizer step so that micro x world x steps == global."""
    per_step = micro_batch_size * world_size
    if global_batch_size <= 0 or micro_batch_size <= 0 or world_size <= 0:
        raise ValueError(
            f"global batch {global_batch_size}, micro batch {micro_batch_size} and world size "
            f"{world_size} must all be positive"
        )
    if global_batch_size % per_step:
        raise ValueError(
            f"global batch size {global_batch_size} is not a multiple of micro batch "
            f"{micro_batch_size} x world size {world_size} = {per_step}; choose a global batch "
            f"divisible by micro batch x every world size the job may run with"
        )
    return global_batch_size // per_step


class ElasticTrainer:
    """Runs gradient accumulation so each optimizer step sees `global_batch_size` samples.

    Use `with trainer.micro_step(): loss = ...; trainer.backward(loss)` for every
    micro-batch; the optimizer steps when the last micro-batch of a global batch leaves the
    block. With DDP, gradient all-reduce is skipped (`no_sync`) on the other micro-batches.
    Losses are scaled by 1 / (accumulation steps), so with mean-reduced losses the update
    equals one over the whole global batch, for any world size.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        global_batch_size: int,
        micro_batch_size: int,
        world_size: int | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.world_size = world_size or _current_world_size()
        self.gradient_accumulation_steps = accumulation_steps(
            global_batch_size, micro_batch_size, self.world_size
        )
        self.micro_steps = 0
        """Micro-batches since the last optimizer step."""
        self.optimizer_steps = 0
        logger.info(
            "global batch %d = micro %d x world %d x accumulation %d",
            global_batch_size,
            micro_batch_size,
            self.world_size,
            self.gradient_accumulation_steps,
        )

    def reset_world(self, world_size: int) -> None:
        """Recompute accumulation for a new world size; only between optimizer steps."""
        if self.micro_steps:
            raise RuntimeError(
                f"world size changed after {self.micro_steps} micro-batches of a global batch; "
                f"change it only between optimizer steps"
            )
        self.gradient_accumulation_steps = accumulation_steps(
            self.global_batch_size, self.micro_batch_size, world_size
        )
        self.world_size = world_size

    @property
    def is_last_micro_step(self) -> bool:
        """True when the next micro-batch completes the global batch (its ``micro_step`` steps the
        optimizer)."""
        return self.micro_steps + 1 >= self.gradient_accumulation_steps

    @contextlib.contextmanager
    def micro_step(self) -> Iterator[bool]:
        """Wraps forward + backward of one micro-batch; yields True on the optimizer step."""
        last = self.is_last_micro_step
        sync: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if isinstance(self.model, DistributedDataParallel) and not last:
            sync = self.model.no_sync()
        with sync:
            yield last
        self.micro_steps += 1
        if last:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.micro_steps = 0
            self.optimizer_steps += 1

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` scaled by 1 / ``gradient_accumulation_steps``."""
        (loss / self.gradient_accumulation_steps).backward()


def _current_world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return WorkerContext.from_env().world_size
