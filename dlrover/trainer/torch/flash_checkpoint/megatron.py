"""MegatronCheckpointer: flash checkpoints in Megatron-LM's iter_<n>/mp_rank_<tp>[_<pp>] layout."""

from __future__ import annotations

import argparse
import enum
import logging
import os
import random
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from dlrover.checkpoint.errors import CheckpointError
from dlrover.checkpoint.formats import MEGATRON_NAMING
from dlrover.checkpoint.object_codec import decode_objects, encode_objects
from dlrover.checkpoint.torch_files import FILES_KEY, PERSIST_KEY, check_file_name
from dlrover.trainer.torch.flash_checkpoint.checkpointer import (
    DEFAULT_SAVE_TIMEOUT_S,
    Checkpointer,
    StorageType,
)
from dlrover.trainer.torch.flash_checkpoint.megatron_torch_dist import (
    MegatronTorchDistCheckpointer,
)

__all__ = [
    "MegatronCheckpointer",
    "ParallelPlace",
    "checkpointer_for",
    "wait_latest_checkpoint",
    "StorageType",
    "checkpoint_file_name",
    "load_checkpoint",
    "save_checkpoint",
]

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 3.0
"""The ``checkpoint_version`` Megatron-LM writes into each file (and checks on load)."""


def checkpoint_file_name(
    tensor_rank: int,
    pipeline_rank: int,
    pipeline_size: int,
    expert_rank: int = 0,
    expert_parallel: bool = False,
    basename: str = "model_optim_rng.pt",
) -> str:
    """A rank's file inside ``iter_<n>/``, as Megatron-LM names it: ``mp_rank_<tp:02>/`` with
    one pipeline stage, ``mp_rank_<tp:02>_<pp:03>/`` with more, ``_<ep:03>`` added with expert
    parallelism, then ``model_optim_rng.pt``."""
    folder = f"mp_rank_{tensor_rank:02d}"
    if pipeline_size > 1:
        folder += f"_{pipeline_rank:03d}"
    if expert_parallel:
        folder += f"_{expert_rank:03d}"
    return f"{folder}/{basename}"


@dataclass(frozen=True)
class ParallelPlace:
    """Where a rank sits in Megatron's layout: what names its file and who persists it."""

    tensor_rank: int = 0
    pipeline_rank: int = 0
    pipeline_size: int = 1
    data_rank: int = 0
    expert_rank: int = 0
    expert_parallel: bool = False

    def file_name(self, basename: str = "model_optim_rng.pt") -> str:
        """This rank's file inside ``iter_<n>/``."""
        return checkpoint_file_name(
            self.tensor_rank,
            self.pipeline_rank,
            self.pipeline_size,
            self.expert_rank,
            self.expert_parallel,
            basename,
        )


def _parallel_place() -> ParallelPlace:
    """This rank's place from megatron.core's parallel state when it is initialized, else one
    stage of one replica."""
    try:
        from megatron.core import parallel_state as ps
    except ImportError:
        return ParallelPlace()
    if not ps.model_parallel_is_initialized():
        return ParallelPlace()
    return ParallelPlace(
        tensor_rank=ps.get_tensor_model_parallel_rank(),
        pipeline_rank=ps.get_pipeline_model_parallel_rank(),
        pipeline_size=ps.get_pipeline_model_parallel_world_size(),
        data_rank=ps.get_data_parallel_rank(),
        expert_rank=ps.get_expert_model_parallel_rank(),
        expert_parallel=ps.get_expert_model_parallel_world_size() > 1,
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
    Not covered: ``megatron.core.dist_checkpointing`` (the distributed format); the distributed
    optimizer's parts are saved by ``megatron_dist_ckpt``.
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
        self.last_files: dict[str, Any] = {}
        """The ``extra_files`` of the last load, by name."""
        self.last_extra: dict[str, Any] = {}
        """The loaded file's entries besides model, optimizer, scheduler and RNG (``iteration``,
        ``num_floating_point_operations_so_far``, ``args``...)."""

    def save_checkpoint(
        self,
        iteration: int,
        model: torch.nn.Module | list[torch.nn.Module],
        optimizer: Any = None,
        opt_param_scheduler: Any = None,
        extra: dict[str, Any] | None = None,
        storage_type: StorageType = StorageType.DISK,
        *,
        place: ParallelPlace | None = None,
        extra_files: dict[str, Any] | None = None,
    ) -> bool:
        """Copy this rank's state as ``iteration`` into shared memory (with DISK also persisted
        in the background). ``extra_files``: more files of the step (names inside
        ``iter_<n>/``) that this rank writes, whatever its data-parallel rank (each rank's part
        of a distributed optimizer's state). ``model``: a module, or Megatron-LM's list of virtual pipeline
        chunks (stored as ``model0``, ``model1``... as Megatron-LM does). ``extra`` entries are
        added to the file (e.g. ``args``, ``num_floating_point_operations_so_far``).
        ``place``: where this rank sits (default: megatron.core's parallel state). Any rank may
        call it; each stage needs data-parallel rank 0's save for a step to reach storage.
        Returns True or raises CheckpointError."""
        if iteration < 0:
            raise CheckpointError(f"iteration must be >= 0, got {iteration}")
        place = place or _parallel_place()
        content: dict[str, Any] = {
            "checkpoint_version": CHECKPOINT_VERSION,
            "iteration": iteration,
            **_model_entries(model),
            "rng_state": [rng_state()],
            **(extra or {}),
        }
        if optimizer is not None:
            content["optimizer"] = optimizer.state_dict()
        if opt_param_scheduler is not None:
            content["opt_param_scheduler"] = opt_param_scheduler.state_dict()
        name = place.file_name()
        files = {name: encode_objects(content)}
        own = [check_file_name(n) for n in extra_files or {}]
        files.update({n: encode_objects(v) for n, v in (extra_files or {}).items()})
        state = {FILES_KEY: files, PERSIST_KEY: ([name] if place.data_rank == 0 else []) + own}
        return self.engine.save(iteration, state, persist=storage_type == StorageType.DISK)

    def load_checkpoint(
        self,
        model: torch.nn.Module | list[torch.nn.Module],
        optimizer: Any = None,
        opt_param_scheduler: Any = None,
        load_dir: str = "",
        strict: bool = True,
        load_rng: bool = True,
        *,
        load_model: bool = True,
        place: ParallelPlace | None = None,
        extra_files: tuple[str, ...] = (),
    ) -> int:
        """Load the newest iteration into ``model`` (and ``optimizer``, ``opt_param_scheduler``,
        the RNG); returns it, 0 when there is no checkpoint (as Megatron-LM). From shared memory
        when every rank holds one not older than storage's, else the newest iteration on storage
        that verifies (``torch.load`` of this rank's stage file); ``load_dir`` (a checkpoint
        directory or one of its ``iter_<n>`` directories) loads from storage. ``load_model``
        False leaves the model as it is. ``extra_files`` (saved through ``save_checkpoint``'s)
        are read into ``last_files``."""
        if load_dir and os.path.abspath(load_dir) == os.path.abspath(self.checkpoint_dir):
            load_dir = ""
        found = self._load_newest(load_dir, None)
        if found is None:
            return 0
        name = (place or _parallel_place()).file_name()
        state = found[1]
        if self.last_load_source == "memory":
            if name not in state[FILES_KEY]:
                raise CheckpointError(f"the checkpoint in memory holds no {name} for this rank")
            content = decode_objects(state[FILES_KEY][name])
        else:
            path = os.path.join(state["dir"], name)
            if not os.path.exists(path):
                raise CheckpointError(
                    f"{path} is missing: the checkpoint in {state['dir']} was saved at another "
                    "tensor/pipeline layout than this rank's; load it at that layout, or "
                    "convert it with Megatron-LM's tools"
                )
            content = torch.load(path, weights_only=False)
        self.last_files = {n: self._read_file(state, n) for n in extra_files}
        if load_model:
            _load_model_entries(model, content, strict)
        if optimizer is not None and "optimizer" in content:
            optimizer.load_state_dict(content["optimizer"])
        if opt_param_scheduler is not None and "opt_param_scheduler" in content:
            opt_param_scheduler.load_state_dict(content["opt_param_scheduler"])
        self.last_extra = {
            k: v
            for k, v in content.items()
            if k not in ("optimizer", "opt_param_scheduler", "rng_state")
            and not (k == "model" or (k.startswith("model") and k[5:].isdigit()))
        }
        if load_rng and content.get("rng_state"):
            set_rng_state(content["rng_state"][0])
        iteration = int(content["iteration"])
        log.info("loaded iteration %d (%s) from %s", iteration, name, self.last_load_source)
        return iteration

    def _read_file(self, state: dict[str, Any], name: str) -> Any:
        """File ``name`` of the loaded step, from memory or storage."""
        if self.last_load_source == "memory":
            if name not in state[FILES_KEY]:
                raise CheckpointError(f"the checkpoint in memory holds no {name} for this rank")
            return decode_objects(state[FILES_KEY][name])
        path = os.path.join(state["dir"], name)
        if not os.path.exists(path):
            raise CheckpointError(f"{path} is missing: the step was saved at another layout")
        return torch.load(path, weights_only=False)

    @staticmethod
    def iteration_dir(iteration: int) -> str:
        """The directory of ``iteration`` inside the checkpoint directory: ``iter_<n:07>``."""
        return MEGATRON_NAMING.dir(iteration)


def _module_state(chunk: torch.nn.Module) -> dict[str, Any]:
    """A chunk's state as Megatron-LM saves it (``state_dict_for_save_checkpoint`` where the
    module has it: megatron's modules leave out what they rebuild)."""
    save = getattr(chunk, "state_dict_for_save_checkpoint", None)
    return dict(save()) if callable(save) else dict(chunk.state_dict())


def _model_entries(model: torch.nn.Module | list[torch.nn.Module]) -> dict[str, Any]:
    """``{"model": ...}`` for one chunk, ``{"model0": ..., "model1": ...}`` for several."""
    chunks = model if isinstance(model, list) else [model]
    if len(chunks) == 1:
        return {"model": _module_state(chunks[0])}
    return {f"model{i}": _module_state(chunk) for i, chunk in enumerate(chunks)}


def _load_model_entries(
    model: torch.nn.Module | list[torch.nn.Module], content: dict[str, Any], strict: bool
) -> None:
    chunks = model if isinstance(model, list) else [model]
    if len(chunks) == 1:
        if "model" not in content:
            raise CheckpointError(
                "the checkpoint holds virtual pipeline chunks; this model has one"
            )
        chunks[0].load_state_dict(content["model"], strict=strict)
        return
    for i, chunk in enumerate(chunks):
        if f"model{i}" not in content:
            raise CheckpointError(f"the checkpoint holds no model{i} (virtual pipeline chunk {i})")
        chunk.load_state_dict(content[f"model{i}"], strict=strict)


# --- DLRover's drop-in functions for Megatron-LM's training loop -------------------------------
# Megatron-LM's `pretrain` calls `save_checkpoint(iteration, model, optimizer, opt_param_scheduler,
# num_floating_point_operations_so_far, checkpointing_context, non_persistent_ckpt=...,
# train_data_iterator=..., preprocess_common_state_dict_fn=..., tp_group=..., ...)` and
# `load_checkpoint(model, optimizer, opt_param_scheduler, checkpointing_context=...,
# skip_load_to_model_and_opt=..., tp_group=..., ...)`, with the directories in its global
# arguments (`--save`, `--load`). DLRover users swap those two imports for these; DLRover's own
# older form (`storage_type` as the sixth argument) is accepted too. A checkpointer is kept per
# directory, because the functions are called once per save, and the shared memory must outlive
# the call.


_C = TypeVar("_C", MegatronCheckpointer, MegatronTorchDistCheckpointer)


class _Checkpointers:
    """The checkpointer of each directory (and format) the functions below were called with."""

    def __init__(self) -> None:
        self.by_dir: dict[tuple[str, type], Checkpointer] = {}

    def get(
        self, kind: type[_C], checkpoint_dir: str, comm_backend: str = "", replica_count: int = 0,
        deletion_strategy: Any = None,
    ) -> _C:  # fmt: skip
        """The directory's checkpointer of ``kind`` (the legacy or the torch_dist format's),
        made by the first call with its arguments."""
        key = (os.path.abspath(checkpoint_dir), kind)
        if key not in self.by_dir:
            self.by_dir[key] = kind(
                key[0],
                comm_backend=comm_backend,
                replica_count=replica_count,
                deletion_strategy=deletion_strategy,
            )
        made = self.by_dir[key]
        assert isinstance(made, kind)
        return made


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


def _maybe_args() -> Any:
    """Megatron-LM's arguments where they exist (None: a loop without Megatron-LM's)."""
    try:
        return _megatron_args()
    except (CheckpointError, AssertionError):  # not importable, or not parsed yet
        return None


def _chunks(model: Any) -> list[torch.nn.Module]:
    """Megatron-LM passes its model as a list of chunks (one per virtual pipeline stage)."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        if not isinstance(chunk, torch.nn.Module):
            raise CheckpointError(
                f"model must be a torch.nn.Module (or a list of them), not {chunk!r}"
            )
    if not chunks:
        raise CheckpointError("model is an empty list")
    return chunks


def _group_place(
    place: ParallelPlace,
    tp_group: Any,
    pp_group: Any,
    dp_group: Any,
    tensor_rank: int | None,
    pipeline_rank: int | None,
    pipeline_parallel: bool | None,
    expert_rank: int | None,
    expert_parallel: bool | None,
) -> ParallelPlace:
    """``place`` with what Megatron-LM's arguments say instead: ranks of the process groups
    given, then the explicit ranks (Megatron-LM's checkpoint-conversion overrides)."""
    if tp_group is not None:
        place = replace(place, tensor_rank=dist.get_rank(tp_group))
    if pp_group is not None:
        size = dist.get_world_size(pp_group)
        place = replace(place, pipeline_rank=dist.get_rank(pp_group), pipeline_size=size)
    if dp_group is not None:
        place = replace(place, data_rank=dist.get_rank(dp_group))
    if tensor_rank is not None:
        place = replace(place, tensor_rank=tensor_rank)
    if pipeline_rank is not None:
        place = replace(place, pipeline_rank=pipeline_rank)
    if pipeline_parallel is not None:
        place = replace(
            place, pipeline_size=max(place.pipeline_size, 2) if pipeline_parallel else 1
        )
    if expert_rank is not None:
        place = replace(place, expert_rank=expert_rank)
    if expert_parallel is not None:
        place = replace(place, expert_parallel=expert_parallel)
    return place


def save_checkpoint(
    iteration: int,
    model: Any,
    optimizer: Any,
    opt_param_scheduler: Any,
    num_floating_point_operations_so_far: float = 0,
    checkpointing_context: Any = None,
    pipeline_rank: int | None = None,
    expert_rank: int | None = None,
    tensor_rank: int | None = None,
    pipeline_parallel: bool | None = None,
    expert_parallel: bool | None = None,
    non_persistent_ckpt: bool = False,
    train_data_iterator: Any = None,
    preprocess_common_state_dict_fn: Any = None,
    release: bool = False,
    tp_group: Any = None,
    pp_group: Any = None,
    dp_cp_group: Any = None,
    dp_group: Any = None,
    expt_dp_group: Any = None,
    rng_state_key_prefix: str = "",
    *,
    storage_type: StorageType = StorageType.DISK,
    storage: Any = None,
    comm_backend: str = "",
    save_timeout: float = DEFAULT_SAVE_TIMEOUT_S,
    replica_count: int = 0,
    deletion_strategy: Any = None,
    checkpoint_dir: str = "",
    extra_files: dict[str, Any] | None = None,
) -> bool:
    """Megatron-LM's ``save_checkpoint`` (its arguments, in its order) through flash
    checkpoint: this rank's state goes to shared memory now, and with DISK to
    ``<--save>/iter_<n:07>/`` in the background, as Megatron-LM's legacy (``--ckpt-format
    torch``) files, ``args`` included. What each of Megatron-LM's arguments does here
    (docs/checkpoint.md has the table): ``non_persistent_ckpt`` saves to memory only (the
    flash checkpoint's cheap save, which outlives a worker's restart); ``train_data_iterator``
    with a ``save_state()`` (Megatron-LM's Energon loaders) has its state in the file under
    ``dataloader_state``; the ranks, process groups and ``rng_state_key_prefix`` place the file
    as Megatron-LM does; ``checkpointing_context`` (Megatron-LM's cache of save strategies),
    ``preprocess_common_state_dict_fn``, ``rng_state_key_prefix`` and
    ``dp_cp_group``/``expt_dp_group`` only matter to ``torch_dist`` saves and are accepted. ``release`` (a converted model, no iteration) is
    refused: save it with Megatron-LM's own function. DLRover's older form passes
    ``storage_type`` sixth: a StorageType there is taken as it. ``checkpoint_dir`` stands in
    for Megatron-LM's ``--save``; ``storage`` and ``save_timeout`` are accepted for DLRover's
    signature (storage is the file system; a step commits once every rank's part is on it).
    ``extra_files``: more files this rank writes into the step (see ``megatron_dist_ckpt``)."""
    del storage, save_timeout, expt_dp_group
    if isinstance(checkpointing_context, StorageType):  # DLRover's positional storage_type
        storage_type, checkpointing_context = checkpointing_context, None
    del checkpointing_context
    if release:
        raise CheckpointError(
            "save_checkpoint(release=True) writes a released model without an iteration; save "
            "it with Megatron-LM's own megatron.training.checkpointing.save_checkpoint"
        )
    args = _maybe_args()
    directory = checkpoint_dir or (args.save if args is not None else "")
    if not directory:
        raise CheckpointError("no directory to save to: Megatron-LM's --save is not set")
    if non_persistent_ckpt:
        storage_type = StorageType.MEMORY
    if ckpt_format(args) == "torch_dist":
        if extra_files:
            raise CheckpointError(
                "extra_files are written in Megatron-LM's torch format only; with torch_dist "
                "the optimizer's sharded state dict holds every rank's part"
            )
        groups = _Groups(tp_group, pp_group, dp_group, dp_cp_group)
        state = _torch_dist_state(
            args, _chunks(model), optimizer, opt_param_scheduler, groups,
            rng_state_key_prefix, iteration=iteration,
        )  # fmt: skip
        state["num_floating_point_operations_so_far"] = num_floating_point_operations_so_far
        torch_dist = _CHECKPOINTERS.get(
            MegatronTorchDistCheckpointer, directory, comm_backend, replica_count, deletion_strategy
        )
        return torch_dist.save_checkpoint(
            iteration,
            state,
            storage_type,
            preprocess_common_state_dict_fn=preprocess_common_state_dict_fn,
            content_metadata=_content_metadata(args),
        )
    del preprocess_common_state_dict_fn, dp_cp_group, rng_state_key_prefix  # torch_dist's only
    place = _group_place(
        _parallel_place(), tp_group, pp_group, dp_group, tensor_rank, pipeline_rank,
        pipeline_parallel, expert_rank, expert_parallel,
    )  # fmt: skip
    extra: dict[str, Any] = {
        "num_floating_point_operations_so_far": num_floating_point_operations_so_far
    }
    if args is not None:
        extra["args"] = storable_args(args)
    save_state = getattr(train_data_iterator, "save_state", None)
    if callable(save_state):
        extra["dataloader_state"] = save_state()
    checkpointer = _CHECKPOINTERS.get(
        MegatronCheckpointer, directory, comm_backend, replica_count, deletion_strategy
    )
    return checkpointer.save_checkpoint(
        iteration,
        _chunks(model),
        optimizer,
        opt_param_scheduler,
        extra=extra,
        storage_type=storage_type,
        place=place,
        extra_files=extra_files,
    )


def load_checkpoint(
    ddp_model: Any,
    optimizer: Any,
    opt_param_scheduler: Any,
    load_arg: str = "load",
    strict: bool = True,
    checkpointing_context: Any = None,
    skip_load_to_model_and_opt: bool = False,
    tp_group: Any = None,
    pp_group: Any = None,
    dp_cp_group: Any = None,
    dp_group: Any = None,
    expt_dp_group: Any = None,
    rng_state_key_prefix: str = "",
    *,
    storage: Any = None,
    comm_backend: str = "",
    save_timeout: float = DEFAULT_SAVE_TIMEOUT_S,
    replica_count: int = 0,
    deletion_strategy: Any = None,
    checkpoint_dir: str = "",
    extra_files: tuple[str, ...] = (),
) -> tuple[int, float]:
    """Megatron-LM's ``load_checkpoint`` (its arguments, in its order) through flash
    checkpoint: the newest iteration from shared memory when every rank holds it, else from
    ``<--load>`` (``load_arg`` names the argument, as in Megatron-LM). Returns ``(iteration,
    num_floating_point_operations_so_far)``, ``(0, 0)`` without a checkpoint, and, as
    Megatron-LM does, sets ``args.consumed_train_samples``, ``skipped_train_samples`` and
    ``consumed_valid_samples`` from the file's ``args`` (and Megatron-LM's number of
    micro-batches from them, where megatron.core has its calculator) unless ``--finetune``;
    ``--no-load-optim``/``--no-load-rng`` skip the optimizer and scheduler / the RNG.
    ``skip_load_to_model_and_opt`` (Megatron-LM's FSDP2 ``torch_dist`` loads, whose tensors are
    already in place) skips the model and the optimizer. ``checkpointing_context`` and the
    process groups other than ``tp_group``/``pp_group`` are accepted. ``checkpoint_dir``
    stands in for the argument; memory is looked up under ``--save``, where the saves went.
    ``extra_files`` names files saved through ``save_checkpoint``'s, read into the directory's
    checkpointer's ``last_files``."""
    del storage, save_timeout, checkpointing_context, expt_dp_group
    args = _maybe_args()
    save_dir, load_dir = load_directories(load_arg, checkpoint_dir)
    finetune = bool(getattr(args, "finetune", False))
    if ckpt_format(args) == "torch_dist":
        return _load_torch_dist(
            args, _chunks(ddp_model), optimizer, opt_param_scheduler,
            _Groups(tp_group, pp_group, dp_group, dp_cp_group), rng_state_key_prefix,
            _CHECKPOINTERS.get(MegatronTorchDistCheckpointer, save_dir, comm_backend,
                            replica_count,
                                          deletion_strategy),
            load_dir=load_dir, strict=strict, skip_model_and_opt=skip_load_to_model_and_opt,
        )  # fmt: skip
    del dp_cp_group, rng_state_key_prefix  # torch_dist's only
    checkpointer = _CHECKPOINTERS.get(
        MegatronCheckpointer, save_dir, comm_backend, replica_count, deletion_strategy
    )
    place = _group_place(
        _parallel_place(), tp_group, pp_group, dp_group, None, None, None, None, None
    )
    iteration = checkpointer.load_checkpoint(
        _chunks(ddp_model),
        None if skip_load_to_model_and_opt or getattr(args, "no_load_optim", False) else optimizer,
        None if getattr(args, "no_load_optim", False) else opt_param_scheduler,
        load_dir=load_dir,
        strict=strict,
        load_rng=not (finetune or getattr(args, "no_load_rng", False)),
        load_model=not skip_load_to_model_and_opt,
        place=place,
        extra_files=extra_files,
    )
    extra = checkpointer.last_extra
    saved_args = extra.get("args")
    if args is not None and saved_args is not None and not finetune:
        _adopt_consumed_samples(args, saved_args)
    if finetune:
        iteration = 0
    return iteration, float(extra.get("num_floating_point_operations_so_far", 0))


def load_directories(load_arg: str = "load", checkpoint_dir: str = "") -> tuple[str, str]:
    """(where the saves went: memory is looked up there, where to load from storage):
    ``checkpoint_dir`` for both, else Megatron-LM's ``--save`` and ``--<load_arg>``."""
    if checkpoint_dir:
        return checkpoint_dir, checkpoint_dir
    args = _megatron_args()
    load_dir = getattr(args, load_arg, None) or ""
    save_dir = getattr(args, "save", None) or load_dir
    if not save_dir:
        raise CheckpointError(f"Megatron-LM's arguments name no --{load_arg} and no --save")
    return save_dir, load_dir


def checkpointer_for(
    checkpoint_dir: str = "",
) -> MegatronCheckpointer | MegatronTorchDistCheckpointer:
    """The checkpointer the functions above use for ``checkpoint_dir`` (default: Megatron-LM's
    ``--save``) in the format of Megatron-LM's ``--ckpt-format`` (its ``last_load_source``
    says where the last load came from)."""
    directory = checkpoint_dir or _megatron_args().save
    if ckpt_format(_maybe_args()) == "torch_dist":
        return _CHECKPOINTERS.get(MegatronTorchDistCheckpointer, directory)
    return _CHECKPOINTERS.get(MegatronCheckpointer, directory)


def wait_latest_checkpoint(timeout: float = 1800.0, checkpoint_dir: str = "") -> bool:
    """Block until the newest DISK save of ``checkpoint_dir`` (default ``--save``) is on
    storage, in the format Megatron-LM's ``--ckpt-format`` names; False at the deadline
    (DLRover's function of the same name)."""
    return checkpointer_for(checkpoint_dir).wait_latest_checkpoint(timeout)


# --- Megatron-LM's torch_dist format (--ckpt-format torch_dist, its default) -------------------

CKPT_FORMATS = ("torch", "torch_dist")
"""The ``--ckpt-format`` values the drop-ins save and load."""


def ckpt_format(args: Any) -> str:
    """Megatron-LM's ``--ckpt-format`` (``torch`` where the arguments have none: Megatron-LM
    before dist_checkpointing, or a loop without Megatron-LM's arguments); CheckpointError for
    a format the drop-ins do not write."""
    fmt = str(getattr(args, "ckpt_format", None) or "torch")
    if fmt not in CKPT_FORMATS:
        raise CheckpointError(
            f"--ckpt-format {fmt}: DLRover's flash checkpoints write Megatron-LM's "
            f"{' and '.join(CKPT_FORMATS)} formats; use one of them (torch_dist reshards "
            "at load like the others)"
        )
    return fmt


@dataclass(frozen=True)
class _Groups:
    """The process groups Megatron-LM passes (None: megatron.core's parallel state)."""

    tp: Any = None
    pp: Any = None
    dp: Any = None
    dp_cp: Any = None

    def _state(self) -> Any:
        try:
            from megatron.core import parallel_state as ps
        except ImportError:
            return None
        return ps if ps.model_parallel_is_initialized() else None

    def rank_size(self, which: str) -> tuple[int, int]:
        """(rank, size) of this process in the ``which`` group ("tp", "pp", "dp", "dp_cp")."""
        group = getattr(self, which)
        if group is not None:
            return dist.get_rank(group), dist.get_world_size(group)
        ps = self._state()
        if ps is None:
            if which in ("dp", "dp_cp") and dist.is_initialized():
                return dist.get_rank(), dist.get_world_size()
            return 0, 1
        if which == "tp":
            return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
        if which == "pp":
            return (ps.get_pipeline_model_parallel_rank(),
                    ps.get_pipeline_model_parallel_world_size())  # fmt: skip
        cp = which == "dp_cp"
        return (ps.get_data_parallel_rank(with_context_parallel=cp),
                ps.get_data_parallel_world_size(with_context_parallel=cp))  # fmt: skip

    def dp_cp_group(self) -> Any:
        if self.dp_cp is not None:
            return self.dp_cp
        ps = self._state()
        return ps.get_data_parallel_group(with_context_parallel=True) if ps else None


def _sharded_metadata(args: Any) -> dict[str, Any]:
    """The metadata Megatron-LM gives sharded_state_dict (and stores as the checkpoint's
    content metadata): how the distributed optimizer's state is sharded, and the defaults of
    today's Megatron-LM."""
    metadata: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if getattr(args, "use_distributed_optimizer", False):
        if getattr(args, "dist_ckpt_optim_fully_reshardable", False):
            metadata["distrib_optim_sharding_type"] = "fully_reshardable"
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = bool(
                getattr(args, "distrib_optim_fully_reshardable_mem_efficient", False)
            )
        else:
            metadata["distrib_optim_sharding_type"] = "dp_reshardable"
    return metadata


def _content_metadata(args: Any) -> dict[str, Any]:
    return _sharded_metadata(args)


def _torch_dist_state(
    args: Any,
    chunks: list[torch.nn.Module],
    optimizer: Any,
    opt_param_scheduler: Any,
    groups: _Groups,
    rng_key_prefix: str,
    *,
    iteration: int | None = None,
    metadata: dict[str, Any] | None = None,
    is_loading: bool = False,
    with_rng: bool = True,
) -> dict[str, Any]:
    """The sharded state dict Megatron-LM's ``generate_state_dict`` builds for ``torch_dist``:
    ``args``, ``checkpoint_version``, ``iteration``, each chunk's ``sharded_state_dict``, the
    optimizer's (unless ``--no-save-optim``), the scheduler's state and the RNG states as a
    ShardedObject per tensor/pipeline rank (unless ``--no-save-rng``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    metadata = dict(metadata if metadata is not None else _sharded_metadata(args))
    metadata["dp_cp_group"] = groups.dp_cp_group()
    state: dict[str, Any] = {"checkpoint_version": CHECKPOINT_VERSION}
    if args is not None:
        state["args"] = storable_args(args)
    if iteration is not None:
        state["iteration"] = iteration
    for i, chunk in enumerate(chunks):
        if not callable(getattr(chunk, "sharded_state_dict", None)):
            raise CheckpointError(
                f"--ckpt-format torch_dist needs megatron.core modules (with "
                f"sharded_state_dict); {type(chunk).__name__} has none: use --ckpt-format torch"
            )
        module: Any = chunk  # a megatron.core module: sharded_state_dict is not torch's
        state["model" if len(chunks) == 1 else f"model{i}"] = module.sharded_state_dict(
            metadata=metadata
        )
    if not getattr(args, "no_save_optim", False):
        if optimizer is not None:
            state["optimizer"] = optimizer.sharded_state_dict(
                state, is_loading=is_loading, metadata=metadata
            )
        if opt_param_scheduler is not None:
            state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
    if with_rng and not getattr(args, "no_save_rng", False):
        states = [rng_state()]
        dp_rank, dp_size = groups.rank_size("dp")
        if getattr(args, "data_parallel_random_init", False) and dp_size > 1:
            gathered: list[Any] = [None] * dp_size
            dist.all_gather_object(gathered, states[0], group=groups.dp)
            states = gathered
        tp_rank, tp_size = groups.rank_size("tp")
        pp_rank, pp_size = groups.rank_size("pp")
        state["rng_state"] = ShardedObject(
            f"{rng_key_prefix}rng_state", states, (pp_size, tp_size), (pp_rank, tp_rank),
            replica_id=groups.rank_size("dp_cp")[0],
        )  # fmt: skip
    return state


def _load_torch_dist(
    args: Any,
    chunks: list[torch.nn.Module],
    optimizer: Any,
    opt_param_scheduler: Any,
    groups: _Groups,
    rng_key_prefix: str,
    checkpointer: MegatronTorchDistCheckpointer,
    *,
    load_dir: str,
    strict: bool,
    skip_model_and_opt: bool,
) -> tuple[int, float]:
    """Megatron-LM's ``torch_dist`` load through flash checkpoint (see ``load_checkpoint``)."""
    finetune = bool(getattr(args, "finetune", False))
    no_optim = bool(getattr(args, "no_load_optim", False))
    load_rng = not (finetune or getattr(args, "no_load_rng", False))
    tp_size = groups.rank_size("tp")[1]
    pp_size = groups.rank_size("pp")[1]

    def request(common: dict[str, Any]) -> dict[str, Any]:
        # As Megatron-LM: what was saved says how to ask (its content metadata), and the RNG
        # states of another tensor/pipeline layout are not loaded.
        saved = common.get("args")
        same = saved is None or (
            getattr(saved, "tensor_model_parallel_size", tp_size) == tp_size
            and getattr(saved, "pipeline_model_parallel_size", pp_size) == pp_size
        )
        return _torch_dist_state(
            args, [] if skip_model_and_opt else chunks,
            None if skip_model_and_opt or no_optim else optimizer, None, groups,
            rng_key_prefix, metadata=common.get("content_metadata"), is_loading=True,
            with_rng=load_rng and same,
        )  # fmt: skip

    found = checkpointer.load_checkpoint(request, load_dir=load_dir)
    if found is None:
        return 0, 0.0
    _, state = found
    if not skip_model_and_opt:
        for i, chunk in enumerate(chunks):
            chunk.load_state_dict(state["model" if len(chunks) == 1 else f"model{i}"], strict)
        if optimizer is not None and not no_optim and "optimizer" in state:
            optimizer.load_state_dict(state["optimizer"])
    if opt_param_scheduler is not None and not no_optim and "opt_param_scheduler" in state:
        opt_param_scheduler.load_state_dict(state["opt_param_scheduler"])
    if isinstance(state.get("rng_state"), list) and state["rng_state"]:
        states = state["rng_state"]
        dp_rank = groups.rank_size("dp")[0]
        pick = dp_rank if getattr(args, "data_parallel_random_init", False) else 0
        set_rng_state(states[min(pick, len(states) - 1)])
    saved_args = state.get("args")
    if args is not None and saved_args is not None and not finetune:
        _adopt_consumed_samples(args, saved_args)
    iteration = 0 if finetune else int(state.get("iteration", 0))
    log.info("loaded iteration %d (torch_dist) from %s", iteration, checkpointer.last_load_source)
    return iteration, float(state.get("num_floating_point_operations_so_far", 0))


def _adopt_consumed_samples(args: Any, saved: Any) -> None:
    """What Megatron-LM's load takes from the checkpoint's arguments: the samples consumed so
    far (after any batch-size ramp-up, iteration x batch size is not it), and the number of
    micro-batches that follows from them."""
    args.consumed_train_samples = getattr(saved, "consumed_train_samples", 0)
    args.skipped_train_samples = getattr(saved, "skipped_train_samples", 0)
    args.consumed_valid_samples = getattr(saved, "consumed_valid_samples", 0)
    try:
        from megatron.core.num_microbatches_calculator import (
            _GLOBAL_NUM_MICROBATCHES_CALCULATOR,
            update_num_microbatches,
        )
    except ImportError:
        return
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None:
        update_num_microbatches(consumed_samples=args.consumed_train_samples, verbose=True)


def storable_args(args: Any) -> argparse.Namespace:
    """A copy of Megatron-LM's ``args`` with what a checkpoint file can hold: numbers, strings,
    dtypes, enums and containers of them (Megatron-LM's loader checks the model's shape and
    reads the consumed samples back from it); anything else (a tokenizer object, a function)
    is left out, with a debug line."""
    kept = argparse.Namespace()
    for key, value in vars(args).items():
        if _storable(value):
            setattr(kept, key, value)
        else:
            log.debug("args.%s (%s) is not stored in the checkpoint", key, type(value).__name__)
    return kept


def _storable(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, enum.Enum)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_storable(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _storable(v) for k, v in value.items())
    return False
