"""FSDP flash checkpointers: sharded (DCP format on storage, reshardable) and full state."""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from dlrover.checkpoint.catalog import step_dir
from dlrover.checkpoint.errors import SegmentStateError
from dlrover.trainer.torch.flash_checkpoint.checkpointer import (
    Checkpointer,
    StorageType,
    resolve_catalog,
    storage_step,
)

__all__ = ["FsdpShardCheckpointer", "FsdpFullCheckpointer", "StorageType"]

log = logging.getLogger(__name__)


class FsdpShardCheckpointer(Checkpointer):
    """Every rank saves its own shards (``get_state_dict``: DTensors) into its shared segment;
    the agent persists all of them in the DCP format, so ``torch.distributed.checkpoint.load``
    reads a step directory directly and a job at another world size can resume from it."""

    sharded = True

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
        memory as ``step``; with DISK the agent also persists them in the DCP format. Returns False
        if a MEMORY save was skipped because the previous step is still being persisted."""
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
        engine = self.engine
        self.last_load_source = None
        catalog, bound = resolve_catalog(engine, resume_path)
        latest = storage_step(catalog)
        state: dict[str, Any] | None = None
        if not resume_path and engine.memory_step(latest) is not None:
            try:
                step, state, _ = engine.load_from_memory(target)
                log.info("loaded step %d from shared memory%s", step, self._from_memory_note())
                self.last_load_source = "memory"
            except SegmentStateError as exc:
                log.warning("cannot load from memory (%s); loading from storage", exc)
        if state is None:
            found = catalog.newest_valid(bound)
            if found is None:
                return {}
            url = catalog.storage.url(step_dir(found[0]))
            target["extra"] = _extra_target(url)
            dcp.load(target, checkpoint_id=url)
            state = target
            self.last_load_source = "storage"
            log.info("loaded step %d from %s", found[0], url)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        return dict(state.get("extra", {}))


def _extra_target(url: str) -> dict[str, Any]:
    """Placeholders for the saved ``extra.*`` entries, so that DCP loads them too."""
    metadata = dcp.FileSystemReader(url).read_metadata()
    extra: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if not fqn.startswith("extra."):
            continue
        *parents, leaf = fqn[len("extra.") :].split(".")
        node = extra
        for key in parents:
            node = node.setdefault(key, {})
        if isinstance(md, TensorStorageMetadata):
            node[leaf] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            node[leaf] = None
    return extra


class FsdpFullCheckpointer(Checkpointer):
    """Gathers the full (unsharded) state on rank 0, which saves it like a DDP checkpoint;
    on load rank 0 reads it and broadcasts it to the other ranks. Simple, not reshardable.
    ``load_checkpoint`` returns the saved ``extra_sd`` on rank 0 only ({} elsewhere)."""

    sharded = False

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
        like a DDP checkpoint; other ranks return True. Returns False if rank 0's MEMORY save was
        skipped because the previous step is still being persisted."""
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
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
        engine = self.engine
        self.last_load_source = None
        catalog, bound = resolve_catalog(engine, resume_path)
        latest = storage_step(catalog)
        from_memory = not resume_path and engine.memory_step(latest) is not None
        state: dict[str, Any] = {}
        if _rank() == 0:
            if from_memory:
                try:
                    state = dict(engine.load_from_memory()[1])
                    self.last_load_source = "memory"
                except SegmentStateError as exc:
                    log.warning("cannot load from memory (%s); loading from storage", exc)
            if not state and (found := catalog.load_newest_plain("rank_0", None, bound)):
                state = dict(found[1])
                self.last_load_source = "storage"
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


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
