"""FSDP flash checkpointers: sharded (DCP format on storage, reshardable) and full state."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from dlrover.trainer.torch.flash_checkpoint.checkpointer import (
    DEFAULT_SAVE_TIMEOUT_S,
    Checkpointer,
    StorageType,
)

__all__ = ["FsdpShardCheckpointer", "FsdpFullCheckpointer", "StorageType"]

log = logging.getLogger(__name__)


class _FsdpCheckpointer(Checkpointer):
    """What both FSDP checkpointers share: DLRover's constructor arguments, in its order."""

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


class FsdpShardCheckpointer(_FsdpCheckpointer):
    """Every rank saves its own shards (``get_state_dict``: DTensors) into its shared segment;
    the agent persists all of them in the DCP format, so ``torch.distributed.checkpoint.load``
    reads a step directory directly and a job at another world size can resume from it."""

    checkpoint_format = "dcp"

    def save_checkpoint(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        extra_sd: dict[str, Any] | None = None,
        path: str = "",
        storage_type: StorageType = StorageType.DISK,
    ) -> bool:
        """Copy this rank's shards of the model and optimizer state, and ``extra_sd``, into shared
        memory as ``step``; with DISK the agent also persists them in the DCP format. Returns True
        (no save is skipped; see DdpCheckpointer.save_checkpoint) or raises CheckpointError."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd, "extra": dict(extra_sd or {})}
        return self._engine_for(path).save(step, state, persist=storage_type == StorageType.DISK)

    def load_checkpoint(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, resume_path: str = ""
    ) -> dict[str, Any]:
        """Load the newest step into ``model`` and ``optimizer``; returns the ``extra_sd``
        that was saved with it ({} when there is no checkpoint)."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        target: dict[str, Any] = {"model": model_sd, "optimizer": optim_sd}
        found = self._load_newest(resume_path, target)
        if found is None:
            return {}
        state = found[1]
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        return dict(state.get("extra", {}))


class FsdpFullCheckpointer(_FsdpCheckpointer):
    """Gathers the full (unsharded) state on rank 0, which saves it like a DDP checkpoint;
    on load rank 0 reads it and broadcasts it to the other ranks. Simple, not reshardable.
    ``load_checkpoint`` returns the saved ``extra_sd`` on rank 0 only ({} elsewhere)."""

    checkpoint_format = "plain"

    def save_checkpoint(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        extra_sd: dict[str, Any] | None = None,
        path: str = "",
        storage_type: StorageType = StorageType.DISK,
    ) -> bool:
        """Gather the full state (a collective: every rank must call it) and save it from rank 0
        like a DDP checkpoint; returns True on every rank (no save is skipped) or raises
        CheckpointError."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=_on_accelerator(model))
        model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
        if _rank() != 0:
            return True
        state = {"model": model_sd, "optimizer": optim_sd, "extra": dict(extra_sd or {})}
        return self._engine_for(path).save(step, state, persist=storage_type == StorageType.DISK)

    def load_checkpoint(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, resume_path: str = ""
    ) -> dict[str, Any]:
        """Rank 0 loads the newest step (shared memory first, then storage) and broadcasts it into
        every rank's model and optimizer; every rank must call it. Returns ``extra_sd`` on rank 0,
        {} on the others and when there is no checkpoint."""
        found = self._load_newest(resume_path, None, reads=_rank() == 0)
        state: dict[str, Any] = {} if found is None else dict(found[1])
        have = torch.tensor([1 if state else 0])
        if dist.is_initialized():
            dist.broadcast(have, src=0)
        if not int(have.item()):
            return {}
        # Separate calls: set_state_dict skips the model when rank k>0 passes an empty dict,
        # and rank 0 would then wait in the broadcast forever.
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, state.get("model", {}), options=options)
        set_optimizer_state_dict(model, optimizer, state.get("optimizer", {}), options=options)
        return dict(state.get("extra", {}))


def _on_accelerator(model: torch.nn.Module) -> bool:
    """True when the model trains on an accelerator (its parameters live there, or the process
    group is not gloo's, as with FSDP1's CPUOffload on CUDA): its full state is then gathered
    to the CPU (cpu_offload). A CPU job's is not: the state is there already, and FSDP1 on the
    CPU fails to offload ("setStorage: ... out of bounds for storage of size 0")."""
    if any(p.device.type != "cpu" for p in model.parameters()):
        return True
    return dist.is_initialized() and dist.get_backend() != "gloo"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
