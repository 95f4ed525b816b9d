"""Where this process sits: the process group's rank and world size, else the worker environment
(RANK, WORLD_SIZE), so samplers and trainers can be built before ``init_process_group``."""

from __future__ import annotations

import torch.distributed as dist

from dlrover.worker_context import WorkerContext


def world_size() -> int:
    """The process group's size, else WORLD_SIZE (1 when unset)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return WorkerContext.from_env().world_size


def rank() -> int:
    """This process's rank in the process group, else RANK (0 when unset)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return WorkerContext.from_env().rank
