"""MegatronCheckpointer: flash checkpoints in Megatron-LM's iter_<n>/mp_rank_<tp>[_<pp>] layout."""

from __future__ import annotations

import logging
import os
import random
from typing import Any

import numpy as np
import torch

from dlrover.checkpoint.errors import CheckpointError
from dlrover.checkpoint.formats import MEGATRON_NAMING
from dlrover.checkpoint.object_codec import decode_objects, encode_objects
from dlrover.checkpoint.torch_files import FILES_KEY, PERSIST_KEY
from dlrover.trainer.torch.flash_checkpoint.checkpointer import (
    DEFAULT_SAVE_TIMEOUT_S,
    Checkpointer,
    StorageType,
)

__all__ = [
    "MegatronCheckpointer",
    "StorageType",
    "checkpoint_file_name",
    "load_checkpoint",
    "save_checkpoint",
]

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 3.0
"""The ``checkpoint_version`` Megatron-LM writes into each file (and checks on load)."""


def checkpoint_file_name(tensor_rank: int, pipeline_rank: int, pipeline_size: int) -> str:
    """A rank's file inside ``iter_<n>/``, as Megatron-LM names it: ``mp_rank_<tp:02>/`` with
    one pipeline stage, ``mp_rank_<tp:02>_<pp:03>/`` with more, then ``model_optim_rng.pt``."""
    folder = f"mp_rank_{tensor_rank:02d}"
    if pipeline_size > 1:
        folder += f"_{pipeline_rank:03d}"
    return f"{folder}/model_optim_rng.pt"


def _parallel_place() -> tuple[int, int, int, int]:
    """(tensor rank, pipeline rank, pipeline size, data-parallel rank) from megatron.core's
    parallel state when it is initialized, else one stage of one replica."""
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return 0, 0, 1, 0
    if not ps.model_parallel_is_initialized():
        return 0, 0, 1, 0
    return (
        ps.get_tensor_model_parallel_rank(),
        ps.get_pipeline_model_parallel_rank(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_data_parallel_rank(),
    )


def rng_state() -> dict[str, Any]:
    """This process's RNG states under the keys Megatron-LM's ``rng_state`` entry uses
    (CPU only: no ``cuda_rng_state``/``rng_tracker_states`` without a GPU)."""
    state: dict[str, Any] = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng_state"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    if "cuda_rng_state" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_rng_state"])


class MegatronCheckpointer(Checkpointer):
    """Flash checkpoints of a Megatron-LM style model (megatron.core, tensor and pipeline
    parallel), in Megatron-LM's legacy (torch) layout.

    Each rank copies its tensor/pipeline stage's state (model, optimizer, LR scheduler, RNG,
    iteration) into shared memory; with DISK the agent writes data-parallel rank 0's copy of each
    stage as ``<dir>/iter_<n:07>/mp_rank_<tp:02>[_<pp:03>]/model_optim_rng.pt`` with
    ``torch.save`` and, once every stage is on storage, ``latest_checkpointed_iteration.txt``.
    Every rank keeps its own copy in memory, so each loads from its own node after a restart.
    Not covered: ``megatron.core.dist_checkpointing`` (the distributed format) and the
    distributed optimizer's ``distrib_optim.pt``.
    """

    checkpoint_format = "megatron"

    def __init__(
        self,
        checkpoint_dir: str,
        comm_backend: str = "",
        deletion_strategy: Any = None,
        save_timeout: float = DEFAULT_SAVE_TIMEOUT_S,
        replica_count: int = 0,
        *,
        keep_last: int = 3,
    ) -> None:
        """DLRover's arguments, in DLRover's order (see Checkpointer), plus ``keep_last``."""
        super().__init__(
            checkpoint_dir,
            comm_backend=comm_backend,
            deletion_strategy=deletion_strategy,
            save_timeout=save_timeout,
            replica_count=replica_count,
            keep_last=keep_last,
        )
        self.last_extra: dict[str, Any] = {}
        """The loaded file's entries besides model, optimizer, scheduler and RNG (``iteration``,
        ``num_floating_point_operations_so_far``, ``args``...)."""

    def save_checkpoint(
        self,
        iteration: int,
        model: torch.nn.Module,
        optimizer: Any = None,
        opt_param_scheduler: Any = None,
        extra: dict[str, Any] | None = None,
        storage_type: StorageType = StorageType.DISK,
    ) -> bool:
        """Copy this rank's state as ``iteration`` into shared memory (with DISK also persisted
        in the background). ``extra`` entries are added to the file (e.g. ``args``,
        ``num_floating_point_operations_so_far``). Any rank may call it; each stage needs
        data-parallel rank 0's save for a step to reach storage. Returns True or raises
        CheckpointError."""
        if iteration < 0:
            raise CheckpointError(f"iteration must be >= 0, got {iteration}")
        tensor_rank, pipeline_rank, pipeline_size, data_rank = _parallel_place()
        content: dict[str, Any] = {
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration,
            "model": model.state_dict(),
            "rng_state": [rng_state()],
            **(extra or {}),
        }
        if optimizer is not None:
            content["optimizer"] = optimizer.state_dict()
        if opt_param_scheduler is not None:
            content["opt_param_scheduler"] = opt_param_scheduler.state_dict()
        name = checkpoint_file_name(tensor_rank, pipeline_rank, pipeline_size)
        state = {
            FILES_KEY: {name: encode_objects(content)},
            PERSIST_KEY: [name] if data_rank == 0 else [],
        }
        return self.engine.save(iteration, state, persist=storage_type == StorageType.DISK)

    def load_checkpoint(
        self,
        model: torch.nn.Module,
        optimizer: Any = None,
        opt_param_scheduler: Any = None,
        load_dir: str = "",
        strict: bool = True,
        load_rng: bool = True,
    ) -> int:
        """Load the newest iteration into ``model`` (and ``optimizer``, ``opt_param_scheduler``,
        the RNG); returns it, 0 when there is no checkpoint (as Megatron-LM). From shared memory
        when every rank holds one not older than storage's, else the newest iteration on storage
        that verifies (``torch.load`` of this rank's stage file); ``load_dir`` (a checkpoint
        directory or one of its ``iter_<n>`` directories) loads from storage."""
        if load_dir and os.path.abspath(load_dir) == os.path.abspath(self.checkpoint_dir):
            load_dir = ""
        found = self._load_newest(load_dir, None)
        if found is None:
            return 0
        tensor_rank, pipeline_rank, pipeline_size, _ = _parallel_place()
        name = checkpoint_file_name(tensor_rank, pipeline_rank, pipeline_size)
        state = found[1]
        if self.last_load_source == "memory":
            if name not in state[FILES_KEY]:
                raise CheckpointError(f"the checkpoint in memory holds no {name} for this rank")
            content = decode_objects(state[FILES_KEY][name])
        else:
            content = torch.load(os.path.join(state["dir"], name), weights_only=False)
        model.load_state_dict(content["model"], strict=strict)
        if optimizer is not None and "optimizer" in content:
            optimizer.load_state_dict(content["optimizer"])
        if opt_param_scheduler is not None and "opt_param_scheduler" in content:
            opt_param_scheduler.load_state_dict(content["opt_param_scheduler"])
        self.last_extra = {
            k: v
            for k, v in content.items()
            if k not in ("model", "optimizer", "opt_param_scheduler", "rng_state")
        }
        if load_rng and content.get("rng_state"):
            set_rng_state(content["rng_state"][0])
        iteration = int(content["iteration"])
        log.info("loaded iteration %d (%s) from %s", iteration, name, self.last_load_source)
        return iteration

    @staticmethod
    def iteration_dir(iteration: int) -> str:
        """The directory of ``iteration`` inside the checkpoint directory: ``iter_<n:07>``."""
        return MEGATRON_NAMING.dir(iteration)


# --- DLRover's drop-in functions for Megatron-LM's training loop -------------------------------
# Megatron-LM's `pretrain` calls `save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
# num_floating_point_operations_so_far)` and `load_checkpoint(model, optimizer,
# opt_param_scheduler)`, with the directories in its global arguments (`--save`, `--load`).
# DLRover users swap those two imports for these; a checkpointer is kept per directory, because
# the functions are called once per save, and the shared memory must outlive the call.


class _Checkpointers:
    """The checkpointer of each directory the functions below were called with."""

    def __init__(self) -> None:
        self.by_dir: dict[str, MegatronCheckpointer] = {}

    def get(self, checkpoint_dir: str, comm_backend: str) -> MegatronCheckpointer:
        key = os.path.abspath(checkpoint_dir)
        if key not in self.by_dir:
            self.by_dir[key] = MegatronCheckpointer(key, comm_backend=comm_backend)
        return self.by_dir[key]


_CHECKPOINTERS = _Checkpointers()


def _megatron_args() -> Any:
    """Megatron-LM's global arguments (``megatron.training.get_args()``, or ``megatron.get_args``
    of releases before megatron/training/)."""
    try:
        from megatron.training import get_args
    except ImportError:
        try:
            from megatron import get_args  # type: ignore[attr-defined,no-redef]
        except ImportError:
            raise CheckpointError(
                "save_checkpoint/load_checkpoint read the directories from Megatron-LM's "
                "arguments (--save, --load), and Megatron-LM's megatron.training is not "
                "importable here; pass checkpoint_dir=..., or use MegatronCheckpointer"
            ) from None
    return get_args()


def _one_chunk(model: Any) -> torch.nn.Module:
    """Megatron-LM passes its model as a list of chunks (one per virtual pipeline stage)."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise CheckpointError(
                f"a model of {len(model)} virtual pipeline chunks is not supported yet; "
                "save without --num-layers-per-virtual-pipeline-stage"
            )
        model = model[0]
    if not isinstance(model, torch.nn.Module):
        raise CheckpointError(f"model must be a torch.nn.Module (or a list of one), not {model!r}")
    return model


def save_checkpoint(
    iteration: int,
    model: Any,
    optimizer: Any,
    opt_param_scheduler: Any,
    num_floating_point_operations_so_far: float = 0,
    storage_type: StorageType = StorageType.DISK,
    storage: Any = None,
    comm_backend: str = "",
    *,
    checkpoint_dir: str = "",
) -> bool:
    """Megatron-LM's ``save_checkpoint`` through flash checkpoint, as DLRover names it: this
    rank's state goes to shared memory now, and with DISK to ``<--save>/iter_<n:07>/`` in the
    background. ``checkpoint_dir`` stands in for Megatron-LM's ``--save``; ``storage`` is
    accepted for DLRover's signature (storage is the local file system)."""
    del storage
    directory = checkpoint_dir or _megatron_args().save
    return _CHECKPOINTERS.get(directory, comm_backend).save_checkpoint(
        iteration,
        _one_chunk(model),
        optimizer,
        opt_param_scheduler,
        extra={"num_floating_point_operations_so_far": num_floating_point_operations_so_far},
        storage_type=storage_type,
    )


def load_checkpoint(
    model: Any,
    optimizer: Any,
    opt_param_scheduler: Any,
    load_arg: str = "load",
    strict: bool = True,
    storage: Any = None,
    comm_backend: str = "",
    *,
    checkpoint_dir: str = "",
) -> tuple[int, float]:
    """Megatron-LM's ``load_checkpoint`` through flash checkpoint: the newest iteration from
    shared memory when every rank holds it, else from ``<--load>`` (``load_arg`` names the
    argument, as in Megatron-LM). Returns ``(iteration, num_floating_point_operations_so_far)``,
    as Megatron-LM's does, ``(0, 0)`` without a checkpoint. ``checkpoint_dir`` stands in for
    the argument; memory is looked up under ``--save``, where the saves went."""
    del storage
    if checkpoint_dir:
        save_dir = load_dir = checkpoint_dir
    else:
        args = _megatron_args()
        load_dir = getattr(args, load_arg, None) or ""
        save_dir = getattr(args, "save", None) or load_dir
        if not save_dir:
            raise CheckpointError(f"Megatron-LM's arguments name no --{load_arg} and no --save")
    checkpointer = _CHECKPOINTERS.get(save_dir, comm_backend)
    chunk = _one_chunk(model)
    iteration = checkpointer.load_checkpoint(
        chunk, optimizer, opt_param_scheduler, load_dir=load_dir, strict=strict
    )
    return iteration, float(checkpointer.last_extra.get("num_floating_point_operations_so_far", 0))
