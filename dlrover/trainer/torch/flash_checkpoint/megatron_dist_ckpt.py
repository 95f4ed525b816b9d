"""DLRover's ``megatron_dist_ckpt``: Megatron-LM's checkpoint functions for jobs that train with
``--use-distributed-optimizer``, every data-parallel rank saving its own part of the optimizer.

Swap Megatron-LM's two imports for these::

    from dlrover.trainer.torch.flash_checkpoint.megatron_dist_ckpt import (
        load_checkpoint,
        save_checkpoint,
    )

Everything ``dlrover.trainer.torch.flash_checkpoint.megatron`` does (its arguments: today's
Megatron-LM and DLRover's older form), plus, with ``args.use_distributed_optimizer`` (and
not ``--no-save-optim``), each rank's part of the distributed optimizer's state — what
megatron-core's ``DistributedOptimizer.get_parameter_state_dp_reshardable()`` returns: this
rank's shard of the fp32 parameters and their moments, no gather — into shared memory at the
same time as the model, on every rank in parallel. Persisted as
``<--save>/iter_<n:07>/rank_<global rank:05d>/distrib_optim.pt`` beside Megatron-LM's
``mp_rank_*/model_optim_rng.pt`` (the layout DLRover's module writes); a restart loads every
part back from memory (``load_parameter_state_from_dp_reshardable``), or from those files at
the same parallel layout. A ``ChainedOptimizer`` (MoE) saves one part per chained optimizer.

Megatron-LM's own loader reads the model files, not these parts (it expects data-parallel rank
0's gathered ``distrib_optim.pt``): a run that must move to Megatron-LM's own checkpoints saves
one with Megatron-LM's ``save_checkpoint``. megatron-core's DistributedOptimizer needs CUDA:
without a GPU this path is exercised with a sharded optimizer offering the same two methods.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from dlrover.trainer.torch.flash_checkpoint import megatron
from dlrover.trainer.torch.flash_checkpoint.checkpointer import (
    DEFAULT_SAVE_TIMEOUT_S,
    KeepLatestStepStrategy,
    StorageType,
)
from dlrover.trainer.torch.flash_checkpoint.megatron import (
    MegatronCheckpointer,
    checkpointer_for,
    wait_latest_checkpoint,
)

__all__ = [
    "KeepLatestStepStrategy",
    "KeepStepIntervalStrategy",
    "MegatronDistCheckpointer",
    "StorageType",
    "dist_optimizer_file",
    "load_checkpoint",
    "save_checkpoint",
    "wait_latest_checkpoint",
]

log = logging.getLogger(__name__)

MegatronDistCheckpointer = MegatronCheckpointer
"""DLRover's name of the checkpointer underneath (one per checkpoint directory)."""


@dataclass(frozen=True)
class KeepStepIntervalStrategy:
    """DLRover's deletion strategy that keeps the steps that are multiples of ``keep_interval``;
    accepted, and not applied: the newest ``keep_last`` (3) steps are kept (give
    KeepLatestStepStrategy to choose how many)."""

    keep_interval: int
    checkpoint_dir: str = ""


def dist_optimizer_file(rank: int) -> str:
    """The file of global rank ``rank``'s optimizer part inside ``iter_<n>/``."""
    return f"rank_{rank:05d}/distrib_optim.pt"


def _own_file() -> str:
    return dist_optimizer_file(dist.get_rank() if dist.is_initialized() else 0)


def _parameter_state(optimizer: Any) -> Any:
    """This rank's part of the optimizer's parameter state (a list for a ChainedOptimizer, None
    where an optimizer is not distributed)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [_parameter_state(o) for o in chained]
    get = getattr(optimizer, "get_parameter_state_dp_reshardable", None)
    return get() if callable(get) else None


def _load_parameter_state(optimizer: Any, state: Any) -> None:
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        for sub, part in zip(chained, state, strict=True):
            _load_parameter_state(sub, part)
        return
    if state is not None:
        optimizer.load_parameter_state_from_dp_reshardable(state)


def _distributed(args: Any) -> bool:
    return bool(getattr(args, "use_distributed_optimizer", False))


def save_checkpoint(
    iteration: int,
    model: Any,
    optimizer: Any,
    opt_param_scheduler: Any,
    num_floating_point_operations_so_far: float = 0,
    checkpointing_context: Any = None,
    *args: Any,
    storage_type: StorageType = StorageType.DISK,
    comm_backend: str = "",
    deletion_strategy: Any = None,
    save_timeout: float = DEFAULT_SAVE_TIMEOUT_S,
    checkpoint_dir: str = "",
    **kwargs: Any,
) -> bool:
    """``megatron.save_checkpoint`` (every argument of Megatron-LM's, and DLRover's
    ``storage_type`` sixth) with this rank's part of the distributed optimizer saved beside
    the model. ``deletion_strategy``: KeepLatestStepStrategy(max_to_keep) sets how many steps
    storage keeps (given on the first call for a directory)."""
    del save_timeout
    megatron_args = megatron._maybe_args()
    extra: dict[str, Any] = {}
    no_save = bool(getattr(megatron_args, "no_save_optim", False))
    # torch_dist saves the distributed optimizer's state in its sharded state dict itself.
    legacy = megatron.ckpt_format(megatron_args) == "torch"
    if optimizer is not None and _distributed(megatron_args) and not no_save and legacy:
        part = _parameter_state(optimizer)
        if part is not None:
            extra[_own_file()] = part
    return megatron.save_checkpoint(
        iteration,
        model,
        optimizer,
        opt_param_scheduler,
        num_floating_point_operations_so_far,
        checkpointing_context,
        *args,
        storage_type=storage_type,
        comm_backend=comm_backend,
        deletion_strategy=deletion_strategy,
        checkpoint_dir=checkpoint_dir,
        extra_files=extra,
        **kwargs,
    )


def load_checkpoint(
    model: Any,
    optimizer: Any,
    opt_param_scheduler: Any,
    load_arg: str = "load",
    strict: bool = True,
    *args: Any,
    comm_backend: str = "",
    deletion_strategy: Any = None,
    save_timeout: float = DEFAULT_SAVE_TIMEOUT_S,
    checkpoint_dir: str = "",
    **kwargs: Any,
) -> tuple[int, float]:
    """``megatron.load_checkpoint`` (every argument of Megatron-LM's) that also loads this
    rank's part of the distributed optimizer, from memory or from its file. Returns
    ``(iteration, num_floating_point_operations_so_far)``."""
    del save_timeout
    if args and isinstance(args[0], str):  # DLRover's older form: comm_backend sixth
        comm_backend, args = args[0], args[1:]
    megatron_args = megatron._maybe_args()
    skip_optim = bool(getattr(megatron_args, "no_load_optim", False)) or kwargs.get(
        "skip_load_to_model_and_opt", False
    )
    legacy = megatron.ckpt_format(megatron_args) == "torch"  # torch_dist loads it itself
    wanted = optimizer is not None and _distributed(megatron_args) and not skip_optim and legacy
    name = _own_file()
    iteration, flops = megatron.load_checkpoint(
        model,
        optimizer,
        opt_param_scheduler,
        load_arg,
        strict,
        *args,
        comm_backend=comm_backend,
        deletion_strategy=deletion_strategy,
        checkpoint_dir=checkpoint_dir,
        extra_files=(name,) if wanted and _has_parts(optimizer) else (),
        **kwargs,
    )
    if iteration and wanted and _has_parts(optimizer):
        save_dir, _ = megatron.load_directories(load_arg, checkpoint_dir)
        checkpointer = checkpointer_for(save_dir)
        assert isinstance(checkpointer, megatron.MegatronCheckpointer)  # the torch format's
        _load_parameter_state(optimizer, checkpointer.last_files[name])
    return iteration, flops


def _has_parts(optimizer: Any) -> bool:
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return any(_has_parts(o) for o in chained)
    return callable(getattr(optimizer, "load_parameter_state_from_dp_reshardable", None))
