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

    DTensors are stored as their local shard plus the global shape and chunk offsets, which is
    what a DCP writer needs to reshard later.
    """
    tensors: list[torch.Tensor] = []
    entries: list[dict[str, Any]] = []
    offset = 0

    def encode(value: Any, path: str) -> Any:
        nonlocal offset
        if isinstance(value, torch.Tensor):
            entry: dict[str, Any] = {"path": path}
            if _is_dtensor(value):
                chunk = value.__create_chunk_list__()[0]  # type: ignore[attr-defined]  # DCP protocol
                entry["global_shape"] = list(value.shape)
                entry["chunk_offsets"] = list(chunk.offsets)
                value = value.to_local()  # type: ignore[attr-defined]
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


def decode(
    meta: dict[str, Any], data: torch.Tensor, target: Any = None, base: int = HEADER_SIZE
) -> Any:
    """Rebuild the state from ``meta`` and the bytes in ``data``.

    Tensors are copied into the matching tensor of ``target`` (same path, shape and dtype) in
    place; otherwise into a fresh tensor. The result never aliases ``data``.
    """
    entries = meta["tensors"]

    def build(node: dict[str, Any], tgt: Any) -> Any:
        if "tensor" in node:
            entry = entries[node["tensor"]]
            src = tensor_view(data, entry, base)
            dest = tgt.to_local() if _is_dtensor(tgt) else tgt
            if (
                isinstance(dest, torch.Tensor)
                and dest.shape == src.shape
                and dest.dtype == src.dtype
            ):
                with torch.no_grad():
                    dest.copy_(src)
                return tgt
            return src.clone()
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


def read_state(seg: SharedSegment, target: Any = None) -> tuple[int, Any, dict[str, Any]]:
    """Load the complete step from ``seg``: (step, state, metadata)."""
    seq, meta = read_metadata(seg)
    state = decode(meta, seg.tensor, target)
    if read_seq(seg) != seq:
        raise SegmentStateError(f"segment {seg.path} was overwritten while it was read")
    return int(meta["step"]), state, meta
