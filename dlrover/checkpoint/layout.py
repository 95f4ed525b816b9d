"""Segment layout: where each tensor of a state goes, the copy into a segment, and decoding."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dlrover.checkpoint.errors import SegmentStateError, StateDictError
from dlrover.checkpoint.header import (
    FORMAT_VERSION,
    HEADER_SIZE,
    begin_write,
    publish,
    read_metadata,
    read_seq,
)
from dlrover.checkpoint.header import align as _align
from dlrover.checkpoint.shm import SharedSegment

# The header protocol (seqlock) lives in header.py, which the agent uses without torch; this
# module places tensors in a segment and rebuilds them, so it is the trainer's side.


def dtype_name(dtype: torch.dtype) -> str:
    """The name a dtype is kept under in the metadata: ``torch.float32`` -> ``float32``."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype named in the metadata; SegmentStateError for a name torch does not know."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise SegmentStateError(f"unknown dtype {name!r} in checkpoint metadata")
    return dtype


def _is_dtensor(value: Any) -> bool:
    return type(value).__name__ == "DTensor" and isinstance(value, torch.Tensor)


def _is_sharded_tensor(value: Any) -> bool:
    # FSDP1's sharded state (a model wrapped without a device mesh). Checked by name like
    # DTensor, and before any tensor attribute: a ShardedTensor answers few of them.
    return type(value).__name__ == "ShardedTensor" and hasattr(value, "local_shards")


def local_part(value: Any) -> torch.Tensor | None:
    """The tensor of ``value`` this rank holds: a DTensor's local shard, a ShardedTensor's one
    local shard (None when this rank holds none of it), or ``value`` itself."""
    if _is_dtensor(value):
        local: torch.Tensor = value.to_local()
        return local
    if _is_sharded_tensor(value):
        shards = value.local_shards()
        return shards[0].tensor if shards else None
    return value if isinstance(value, torch.Tensor) else None


@dataclass
class Layout:
    """Where each tensor of one state dict goes in a segment, plus the JSON that describes it."""

    tree: Any
    tensors: list[torch.Tensor]
    entries: list[dict[str, Any]]
    data_len: int
    extra: dict[str, Any] = field(default_factory=dict)

    def metadata(self, step: int) -> bytes:
        """The segment's JSON metadata for ``step``: format version, tree, tensor entries, data
        length and ``extra``, compactly encoded."""
        doc = {
            "version": FORMAT_VERSION,
            "step": step,
            "tree": self.tree,
            "tensors": self.entries,
            "data_len": self.data_len,
            **self.extra,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    def required_bytes(self, step: int) -> int:
        """Segment size needed: header, data, metadata (with slack for a longer step number)."""
        return HEADER_SIZE + _align(self.data_len) + len(self.metadata(step)) + 64


def plan_layout(state: Any, extra: dict[str, Any] | None = None) -> Layout:
    """Walk ``state`` (nested dict/list/tuple of tensors and JSON values) and place its tensors.

    DTensors (FSDP2) and ShardedTensors (FSDP1) are stored as their local shard plus the global
    shape and chunk offsets, which is what a DCP writer needs to reshard later.
    """
    tensors: list[torch.Tensor] = []
    entries: list[dict[str, Any]] = []
    offset = 0

    def place(value: torch.Tensor, entry: dict[str, Any], path: str) -> dict[str, int]:
        nonlocal offset
        if value.is_sparse or value.layout != torch.strided:
            raise StateDictError(f"{path}: only dense (strided) tensors can be saved")
        nbytes = value.numel() * value.element_size()
        entry.update(
            dtype=dtype_name(value.dtype), shape=list(value.shape), offset=offset, nbytes=nbytes
        )
        offset = _align(offset + nbytes)
        tensors.append(value)
        entries.append(entry)
        return {"tensor": len(tensors) - 1}

    def encode(value: Any, path: str) -> Any:
        if _is_sharded_tensor(value):
            shards = value.local_shards()
            if len(shards) > 1:
                raise StateDictError(
                    f"{path}: a ShardedTensor with {len(shards)} local shards on one rank cannot "
                    f"be saved; FSDP gives each rank at most one"
                )
            global_shape = list(value.size())
            if not shards:  # this rank holds none of it: nothing to copy or write
                entries.append(
                    {"path": path, "global_shape": global_shape, "empty_shard": True,
                     "chunk_offsets": [0] * len(global_shape), "dtype": dtype_name(value.dtype),
                     "shape": [0] * len(global_shape), "offset": offset, "nbytes": 0}
                )  # fmt: skip
                tensors.append(torch.empty(0, dtype=value.dtype))
                return {"tensor": len(tensors) - 1}
            entry = {
                "path": path,
                "global_shape": global_shape,
                "chunk_offsets": list(shards[0].metadata.shard_offsets),
            }
            return place(shards[0].tensor, entry, path)
        if isinstance(value, torch.Tensor):
            entry = {"path": path}
            if _is_dtensor(value):
                chunk = value.__create_chunk_list__()[0]  # type: ignore[attr-defined]  # DCP protocol
                entry["global_shape"] = list(value.shape)
                entry["chunk_offsets"] = list(chunk.offsets)
                value = value.to_local()  # type: ignore[attr-defined]
            return place(value, entry, path)
        if isinstance(value, dict):
            items = []
            for key, item in value.items():
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise StateDictError(f"{path}: key {key!r} must be a str or an int")
                items.append([key, encode(item, f"{path}.{key}" if path else str(key))])
            return {"dict": items}
        if isinstance(value, (list, tuple)):
            kind = "list" if isinstance(value, list) else "tuple"
            return {kind: [encode(v, f"{path}.{i}") for i, v in enumerate(value)]}
        if isinstance(value, torch.dtype):
            return {"dtype": dtype_name(value)}
        if value is None or isinstance(value, (bool, int, float, str)):
            return {"value": value}
        if hasattr(value, "item") and callable(value.item):  # numpy scalars
            return {"value": value.item()}
        raise StateDictError(
            f"{path or '<root>'}: a {type(value).__name__} cannot be stored in a flash checkpoint;"
            " use tensors, dicts, lists, tuples, str, int, float, bool or None"
        )

    tree = encode(state, "")
    return Layout(tree, tensors, entries, offset, dict(extra or {}))


def write_state(
    seg: SharedSegment, layout: Layout, step: int, after_tensor: Callable[[int], None] | None = None
) -> None:
    """Copy the state into ``seg`` (one memcpy per tensor) and publish it as ``step``.

    ``after_tensor(i)`` runs after tensor ``i`` is copied; it exists for fault injection.
    """
    meta = layout.metadata(step)
    meta_offset = HEADER_SIZE + _align(layout.data_len)
    if meta_offset + len(meta) > seg.size:
        raise SegmentStateError(
            f"segment {seg.path} of {seg.size} bytes is too small for "
            f"{meta_offset + len(meta)} bytes; allocate it first"
        )
    writing = begin_write(seg)
    data = seg.tensor
    with torch.no_grad():
        for i, (tensor, entry) in enumerate(zip(layout.tensors, layout.entries, strict=True)):
            start = HEADER_SIZE + entry["offset"]
            view = data[start : start + entry["nbytes"]].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            if after_tensor is not None:
                after_tensor(i)
    publish(seg, writing, step, layout.data_len, meta)


def tensor_view(data: torch.Tensor, entry: dict[str, Any], base: int = HEADER_SIZE) -> torch.Tensor:
    """A tensor aliasing the bytes of ``entry`` inside the uint8 tensor ``data``."""
    start = base + entry["offset"]
    dtype = dtype_from_name(entry["dtype"])
    return data[start : start + entry["nbytes"]].view(dtype).view(entry["shape"])


@dataclass(frozen=True)
class TargetOf:
    """A load target that depends on what the segment holds: ``build(metadata)`` returns the
    target, once the segment's metadata is read (a checkpointer that must see what was saved
    to say where each tensor goes)."""

    build: Callable[[dict[str, Any]], Any]


TensorPlacer = Callable[[int, dict[str, Any], Any], Any]
"""``place(index, entry, tgt)``: the value of the tree's tensor ``index`` (``entry``: its
metadata; ``tgt``: the matching node of the caller's target, or None)."""


def rebuild(meta: dict[str, Any], target: Any, place: TensorPlacer) -> Any:
    """Rebuild the state's tree from ``meta``, walking ``target`` alongside: each tensor's value
    is what ``place`` returns (a tensor this rank holds none of keeps ``target``'s node). A
    ``TargetOf`` target is built from ``meta`` first."""
    entries = meta["tensors"]
    if isinstance(target, TargetOf):
        target = target.build(meta)

    def build(node: dict[str, Any], tgt: Any) -> Any:
        if "tensor" in node:
            entry = entries[node["tensor"]]
            if entry.get("empty_shard"):
                return tgt  # this rank held none of it: nothing to load
            return place(node["tensor"], entry, tgt)
        if "dict" in node:
            tmap = tgt if isinstance(tgt, dict) else {}
            return {k: build(v, tmap.get(k)) for k, v in node["dict"]}
        for kind in ("list", "tuple"):
            if kind in node:
                tseq = tgt if isinstance(tgt, (list, tuple)) else ()
                out = [
                    build(v, tseq[i] if i < len(tseq) else None) for i, v in enumerate(node[kind])
                ]
                return out if kind == "list" else tuple(out)
        if "dtype" in node:
            return dtype_from_name(node["dtype"])
        return node["value"]

    return build(meta["tree"], target)


def decode(
    meta: dict[str, Any], data: torch.Tensor, target: Any = None, base: int = HEADER_SIZE
) -> Any:
    """Rebuild the state from ``meta`` and the bytes in ``data``.

    Tensors are copied into the matching tensor of ``target`` (same path, shape and dtype) in
    place; otherwise into a fresh tensor. The result never aliases ``data``.
    """

    def place(index: int, entry: dict[str, Any], tgt: Any) -> Any:
        src = tensor_view(data, entry, base)
        dest = local_part(tgt)
        if isinstance(dest, torch.Tensor) and dest.shape == src.shape and dest.dtype == src.dtype:
            with torch.no_grad():
                dest.copy_(src)
            return tgt
        return src.clone()

    return rebuild(meta, target, place)


def read_state(seg: SharedSegment, target: Any = None) -> tuple[int, Any, dict[str, Any]]:
    """Load the complete step from ``seg``: (step, state, metadata)."""
    seq, meta = read_metadata(seg)
    state = decode(meta, seg.tensor, target)
    if read_seq(seg) != seq:
        raise SegmentStateError(f"segment {seg.path} was overwritten while it was read")
    return int(meta["step"]), state, meta
