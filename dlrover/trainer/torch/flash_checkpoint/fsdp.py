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
    DEFAULT_SAVE_TIMEOUT_S,
    Checkpointer,
    StorageType,
    resolve_catalog,
    storage_step,
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
        engine = self.engine
        self.last_load_source = None
        catalog, bound = resolve_catalog(engine, resume_path)
        latest = storage_step(catalog)
        state: dict[str, Any] | None = None
        in_memory = None if resume_path else engine.memory_step(latest)
        if in_memory is not None:
            try:
                step, state, _ = engine.load_from_memory(target, in_memory)
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
            # FSDP1 gives a rank no part of a tensor smaller than the world (a Linear(d, 1)
            # head): DCP cannot load such an entry, and there is nothing to load into it.
            removed = _pop_empty_shards(target)
            try:
                dcp.load(target, checkpoint_id=url)
            finally:
                for node, key, value in removed:
                    node[key] = value
            state = target
            self.last_load_source = "storage"
            log.info("loaded step %d from %s", found[0], url)
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
        return dict(state.get("extra", {}))


def _pop_empty_shards(tree: Any) -> list[tuple[dict[Any, Any], Any, Any]]:
    """Take out of ``tree`` (in place) the ShardedTensors this rank holds no shard of, and return
    where they were, to be put back once DCP has loaded the rest (DCP fills the caller's dicts
    in place, so the tree itself must be what it loads)."""
    removed: list[tuple[dict[Any, Any], Any, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for key in list(node):
                value = node[key]
                if type(value).__name__ == "ShardedTensor" and not value.local_shards():
                    removed.append((node, key, value))
                    del node[key]
                else:
                    walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(tree)
    return removed


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


class FsdpFullCheckpointer(_FsdpCheckpointer):
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
        engine = self.engine
        self.last_load_source = None
        catalog, bound = resolve_catalog(engine, resume_path)
        latest = storage_step(catalog)
        in_memory = None if resume_path else engine.memory_step(latest)
        state: dict[str, Any] = {}
        if _rank() == 0:
            if in_memory is not None:
                try:
                    state = dict(engine.load_from_memory(None, in_memory)[1])
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
