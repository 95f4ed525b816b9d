"""Flash checkpoints in Megatron-LM's ``torch_dist`` format (megatron.core's
``dist_checkpointing``, Megatron-LM's default ``--ckpt-format``).

A save takes the sharded state dict Megatron-LM builds (``ShardedTensor``s and
``ShardedObject``s of the model and optimizer, and common state), runs megatron.core's own
preprocessing on it (factories, non-persistent entries, common state, and on the first save
the check that every shard has exactly one main replica), and copies each rank's local
chunks into shared memory: the training loop goes on after that copy. With DISK the agent then
writes the step as megatron.core writes it: ``iter_<n:07>/`` with the DCP files of the main
replicas (``__<rank>_0.distcp``, ``.metadata``), ``common.pt`` and ``metadata.json``, then
``latest_checkpointed_iteration.txt``. megatron.core's ``dist_checkpointing.load`` reads that
directory at any tensor, pipeline or data-parallel layout.

A load after a restart at the same layout reads every rank's chunks back from its node's
memory (no file is read) and rebuilds the state dict as megatron.core's load does (factories
merged, common state added); at another layout, or when memory holds nothing newer, it loads
the newest step on storage with megatron.core's own loader, which reshards.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dlrover.checkpoint.errors import CheckpointError, SegmentStateError, StateDictError
from dlrover.checkpoint.layout import TargetOf, dtype_name, rebuild
from dlrover.checkpoint.mcore_writer import COMMON_FILE, TORCH_DIST_KEY
from dlrover.checkpoint.object_codec import decode_objects, encode_objects
from dlrover.checkpoint.torch_files import FILES_KEY, PERSIST_KEY
from dlrover.trainer.torch.flash_checkpoint.checkpointer import (
    Checkpointer,
    StorageType,
    every_rank_holds,
    resolve_catalog,
)

__all__ = ["MegatronTorchDistCheckpointer", "StorageType"]

log = logging.getLogger(__name__)

ShardedRequest = dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]]
"""What to load: a sharded state dict, or a function of the step's common state returning one."""


class MegatronTorchDistCheckpointer(Checkpointer):
    """Flash checkpoints of megatron.core sharded state dicts, persisted in Megatron-LM's
    ``torch_dist`` layout (see the module's text). Every rank saves and loads its own part."""

    checkpoint_format = "megatron_torch_dist"
    _validated = False
    """Whether a save checked, across ranks, that every shard has one main replica (the first
    save does: the state's structure does not change between saves)."""

    def save_checkpoint(
        self,
        iteration: int,
        sharded_state_dict: dict[str, Any],
        storage_type: StorageType = StorageType.DISK,
        *,
        validate_access_integrity: bool | None = None,
        preprocess_common_state_dict_fn: Any = None,
        content_metadata: dict[str, Any] | None = None,
    ) -> bool:
        """Copy this rank's part of ``sharded_state_dict`` (what megatron.core's
        ``dist_checkpointing.save`` takes) into shared memory as ``iteration``; with DISK also
        persisted in the background. ``validate_access_integrity`` (default: on the first save
        only, as Megatron-LM with ``--ckpt-assume-constant-structure``) checks across ranks that
        every shard is saved exactly once; ``preprocess_common_state_dict_fn`` and
        ``content_metadata`` as in megatron.core. Returns True or raises CheckpointError."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
        from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
        from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization

        if iteration < 0:
            raise CheckpointError(f"iteration must be >= 0, got {iteration}")
        if content_metadata is not None:  # where dist_checkpointing.save puts it
            sharded_state_dict["content_metadata"] = _clean_metadata_for_serialization(
                content_metadata
            )
        validate = (
            not self._validated
            if validate_access_integrity is None
            else (validate_access_integrity)
        )
        sharded, common = save_preprocess(
            sharded_state_dict, validate, preprocess_common_state_dict_fn
        )
        self._validated = self._validated or validate
        tensors: list[dict[str, Any]] = []
        objects: list[dict[str, Any]] = []
        for value in nested_values(sharded):
            if isinstance(value, ShardedTensor):
                tensors.append(_chunk(value))
            elif isinstance(value, ShardedObject):
                objects.append(
                    {
                        "key": value.unique_key,
                        "main": _is_main(value.replica_id),
                        "data": encode_objects(value.data),
                    }
                )
            else:
                raise CheckpointError(
                    f"{type(value).__name__} in the sharded state dict is not saved by flash "
                    "checkpoints (ShardedTensor and ShardedObject are)"
                )
        state = {
            FILES_KEY: {COMMON_FILE: encode_objects(common)},
            PERSIST_KEY: [COMMON_FILE] if _rank() == 0 else [],
            TORCH_DIST_KEY: {"tensors": tensors, "objects": objects},
        }
        return self.engine.save(iteration, state, persist=storage_type == StorageType.DISK)

    def load_checkpoint(
        self,
        sharded_state_dict: ShardedRequest,
        load_dir: str = "",
        strict: Any = None,
    ) -> tuple[int, dict[str, Any]] | None:
        """(iteration, state dict) of the newest step, as megatron.core's
        ``dist_checkpointing.load(sharded_state_dict, ...)`` returns it; None when there is no
        checkpoint. From shared memory when every rank holds the step and this rank's chunks
        are all there (the same layout), else the newest step on storage (or in ``load_dir``:
        a checkpoint directory or one of its ``iter_<n>`` directories) through megatron.core's
        loader, which reshards. ``sharded_state_dict`` may be a function of the step's common
        state (its ``args``, ``content_metadata``) that returns the sharded state dict to load,
        as Megatron-LM builds it after reading them. ``strict``: megatron.core's strictness for
        storage loads."""
        if load_dir and os.path.abspath(load_dir) == os.path.abspath(self.checkpoint_dir):
            load_dir = ""  # the directory saved to: memory may hold a newer step
        plan = _MemoryLoad(sharded_state_dict)
        found = self._load_newest(load_dir, TargetOf(plan.target))
        if found is None:
            return None
        step, state = found
        if self.last_load_source == "memory":
            loaded: dict[str, Any] | None = None
            try:
                loaded = plan.finish(state)
            except SegmentStateError as exc:
                log.warning("step %d in memory does not fit this rank's state: %s", step, exc)
            if every_rank_holds(loaded is not None):
                assert loaded is not None
                return step, loaded
            log.warning(
                "step %d could not be loaded from memory by every rank (another parallel "
                "layout?); every rank loads the newest step on storage instead",
                step,
            )
            self.last_load_source = None
            catalog, bound = resolve_catalog(self.engine, load_dir)
            found = self.engine.format.load_newest(catalog, None, bound)
            if found is None:
                return None
            step, state = found
            self.last_load_source = "storage"
        return step, _from_storage(sharded_state_dict, str(state["dir"]), strict)

    @staticmethod
    def iteration_dir(iteration: int) -> str:
        """The directory of ``iteration`` inside the checkpoint directory: ``iter_<n:07>``."""
        return f"iter_{iteration:07d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _is_main(replica_id: Any) -> bool:
    """megatron.core's rule: the main replica has replica id 0 (in every component)."""
    ids = replica_id if isinstance(replica_id, tuple) else (replica_id,)
    return all(r == 0 for r in ids)


def _chunk(sh_ten: Any) -> dict[str, Any]:
    """A ShardedTensor's local chunk as DCP stores it: at its global offset, with megatron's
    prepended axes (a layer's index in the stack) as leading axes of size 1."""
    if sh_ten.flattened_range is not None:
        raise CheckpointError(
            f"{sh_ten.key}: a flattened optimizer shard (the distributed optimizer's "
            "dp_zero_gather_scatter or bucket-space formats) is not saved in torch_dist by flash "
            "checkpoints; use --dist-ckpt-optim-fully-reshardable or the default dp_reshardable"
        )
    if sh_ten.data is None:
        raise CheckpointError(f"{sh_ten.key}: the ShardedTensor holds no data to save")
    data = sh_ten.data.detach()
    if not data.is_contiguous():
        data = data.contiguous()
    data = data.view((1,) * sh_ten.prepend_axis_num + tuple(sh_ten.local_shape))
    return {
        "key": sh_ten.key,
        "offset": [int(o) for o in sh_ten.global_offset],
        "global_shape": [int(s) for s in sh_ten.global_shape],
        "main": _is_main(sh_ten.replica_id),
        "data": data,
    }


class _MemoryLoad:
    """A load from memory as megatron.core's load does it (its ``load_preprocess``, factory
    merges, the common state), each chunk copied once: the segment's chunks land straight in
    the tensors the sharded state dict asks for (``target``, built once the segment's metadata
    says what it holds), and ``finish`` rebuilds the state dict around them."""

    def __init__(self, request: ShardedRequest) -> None:
        self.request = request
        self.prepared: tuple[Any, Any, Any] | None = None

    def _prepare(self, common: dict[str, Any]) -> tuple[Any, Any, Any]:
        from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
        from megatron.core.dist_checkpointing.utils import extract_sharded_base

        request = self.request(common) if callable(self.request) else self.request
        sharded, nonpersistent, factories = load_preprocess(request)
        sharded, _ = extract_sharded_base(sharded)
        return sharded, nonpersistent, factories

    def target(self, meta: dict[str, Any]) -> Any:
        """Where each saved chunk goes: the asked-for tensor of its key and offset, seen in the
        saved chunk's shape (None where there is none to write into: a fresh tensor then)."""
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        self.prepared = None
        saved = rebuild(meta, None, _entry)  # tensors stand as their entries: nothing is read
        try:
            # Its few tensors (an optimizer's common step) stand as entries here: what says
            # how to ask (the saved args, the content metadata) holds none.
            common = decode_objects(saved[FILES_KEY][COMMON_FILE])
        except (KeyError, TypeError, AttributeError, StateDictError):
            return None  # not this format's, or objects built from tensors: read it whole
        self.prepared = self._prepare(common)
        asked = {
            (value.key, tuple(int(o) for o in value.global_offset)): value.data
            for value in nested_values(self.prepared[0])
            if isinstance(value, ShardedTensor) and value.data is not None
        }
        chunks: list[dict[str, torch.Tensor] | None] = []
        for part in saved[TORCH_DIST_KEY]["tensors"]:
            dest = asked.get((part["key"], tuple(part["offset"])))
            entry = part["data"]
            if (
                isinstance(dest, torch.Tensor)
                and dest.device.type == "cpu"
                and dest.is_contiguous()
                and dest.numel() == math.prod(entry["shape"])
                and dtype_name(dest.dtype) == entry["dtype"]
            ):
                chunks.append({"data": dest.view(entry["shape"])})
            else:
                chunks.append(None)
        return {TORCH_DIST_KEY: {"tensors": chunks}}

    def finish(self, state: dict[str, Any]) -> dict[str, Any]:
        """What megatron.core's load returns, from this rank's memory copy ``state``;
        SegmentStateError if a chunk or object the state dict asks for is not there."""
        from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge
        from megatron.core.dist_checkpointing.mapping import (
            ShardedObject,
            ShardedTensor,
            apply_factory_merges,
        )

        common = decode_objects(state[FILES_KEY][COMMON_FILE])
        sharded, nonpersistent, factories = self.prepared or self._prepare(common)
        merge(common, nonpersistent)
        saved = state[TORCH_DIST_KEY]
        chunks = {(p["key"], tuple(p["offset"])): p["data"] for p in saved["tensors"]}
        objects: dict[str, list[Any]] = {}
        for part in saved["objects"]:
            objects.setdefault(part["key"], []).append(part["data"])

        def fill(value: Any) -> Any:
            if isinstance(value, ShardedTensor):
                data = chunks.get((value.key, tuple(int(o) for o in value.global_offset)))
                if data is None:
                    raise SegmentStateError(f"no chunk of {value.key} at {value.global_offset}")
                tensor = data.view(tuple(value.local_shape))
                if value.data is None:
                    return tensor
                if value.data.data_ptr() != tensor.data_ptr():  # not read straight into it
                    with torch.no_grad():
                        value.data.copy_(tensor)
                return value.data
            if isinstance(value, ShardedObject):
                found = objects.get(value.unique_key)
                if not found:
                    raise SegmentStateError(f"no object {value.unique_key}")
                return decode_objects(found.pop(0))
            return value

        dict_list_map_inplace(fill, sharded)
        merge(common, sharded)
        loaded: dict[str, Any] = apply_factory_merges(common, factories)
        return loaded


def _entry(index: int, entry: dict[str, Any], target: Any) -> dict[str, Any]:
    """A tensor's metadata entry in its place (a tree read without its data)."""
    del index, target
    return entry


def _from_storage(
    sharded_state_dict: ShardedRequest, directory: str, strict: Any
) -> dict[str, Any]:
    """megatron.core's own load of a ``torch_dist`` directory (it reshards)."""
    from megatron.core import dist_checkpointing

    if callable(sharded_state_dict):
        common = dist_checkpointing.load_common_state_dict(directory)
        sharded_state_dict = sharded_state_dict(common)
    if strict is None:
        loaded: dict[str, Any] = dist_checkpointing.load(sharded_state_dict, directory)
    else:
        loaded = dist_checkpointing.load(sharded_state_dict, directory, strict=strict)
    return loaded
