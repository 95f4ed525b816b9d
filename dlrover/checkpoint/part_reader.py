"""Where a stored plain part's bytes land when read: straight into the target's tensors."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import torch

from dlrover.checkpoint.errors import CheckpointCorruptError
from dlrover.checkpoint.layout import _is_dtensor, dtype_from_name
from dlrover.checkpoint.read_ranges import Span


def writable_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor as a writable memoryview (no numpy needed); the
    caller keeps ``tensor`` alive while the view is used."""
    nbytes = tensor.numel() * tensor.element_size()
    if not nbytes:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


@dataclass
class PartPlan:
    """The read of one plain part: ``spans`` cover the data file in order; entry ``i`` of the
    metadata lands in ``tensors[i]`` and appears in the state as ``results[i]`` (the target's
    own object where it matched, else a fresh tensor)."""

    meta: dict[str, Any]
    spans: list[Span]
    tensors: list[torch.Tensor]
    results: list[Any]
    staged: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    """(target tensor, fresh tensor read instead) for targets that cannot be read into directly
    (not contiguous, not on the CPU, or sharing memory with another target); copied by
    ``finish``."""
    written: set[int] = field(default_factory=set)
    """Addresses of target tensors the read writes into directly."""

    def finish(self) -> Any:
        """After a read that verified: copy the staged tensors into their targets and return the
        state (the target's tensors where they matched)."""
        with torch.no_grad():
            for dest, staged in self.staged:
                dest.copy_(staged)
        return _build(self.meta["tree"], self.results)


def plan_part(meta: dict[str, Any], target: Any = None) -> PartPlan:
    """Plan reading the data file described by ``meta``: each tensor goes into the tensor of
    ``target`` at the same path with the same shape and dtype, else into a fresh tensor.
    CheckpointCorruptError if the metadata's entries do not tile its ``data_len`` bytes."""
    entries: list[dict[str, Any]] = meta["tensors"]
    data_len = int(meta["data_len"])
    matched: list[Any] = [None] * len(entries)
    _match(meta["tree"], target, matched)
    tensors: list[torch.Tensor] = []
    results: list[Any] = []
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    direct: list[int] = []  # entries read straight into their target
    for i, entry in enumerate(entries):
        dtype = dtype_from_name(entry["dtype"])
        shape = list(entry["shape"])
        tgt = matched[i]
        dest = tgt.to_local() if _is_dtensor(tgt) else tgt
        if isinstance(dest, torch.Tensor) and dest.dtype == dtype and list(dest.shape) == shape:
            results.append(tgt)
            if dest.device.type == "cpu" and dest.is_contiguous():
                tensors.append(dest)
                direct.append(i)
            else:
                fresh = torch.empty(shape, dtype=dtype)
                staged.append((dest, fresh))
                tensors.append(fresh)
        else:
            fresh = torch.empty(shape, dtype=dtype)
            results.append(fresh)
            tensors.append(fresh)
        if tensors[-1].numel() * tensors[-1].element_size() != int(entry["nbytes"]):
            raise CheckpointCorruptError(
                f"checkpoint metadata of {entry.get('path')!r}: {entry['nbytes']} bytes do not "
                f"hold a {dtype} tensor of shape {shape}"
            )
    # Two targets sharing memory (tied weights) must not be written by two threads at once,
    # or one thread's checksum could see the other's bytes: read the later one aside.
    kept_end = -1
    written: set[int] = set()
    for i in sorted(direct, key=lambda k: tensors[k].data_ptr()):
        start = tensors[i].data_ptr()
        nbytes = int(entries[i]["nbytes"])
        if not nbytes:
            continue
        if start < kept_end:
            fresh = torch.empty_like(tensors[i])
            staged.append((tensors[i], fresh))
            tensors[i] = fresh
            continue
        kept_end = start + nbytes
        written.add(start)
    return PartPlan(meta, _spans(entries, tensors, data_len), tensors, results, staged, written)


def _spans(entries: list[dict[str, Any]], tensors: list[torch.Tensor], data_len: int) -> list[Span]:
    """Spans covering [0, data_len) in file order: each tensor's bytes, and the alignment gaps
    between them read into scratch bytes of their own (so that no two threads share one)."""
    order = sorted(range(len(entries)), key=lambda i: int(entries[i]["offset"]))
    spans: list[Span] = []
    at = 0
    for i in order:
        offset, nbytes = int(entries[i]["offset"]), int(entries[i]["nbytes"])
        if offset < at or offset + nbytes > data_len:
            raise CheckpointCorruptError(
                f"checkpoint metadata of {entries[i].get('path')!r}: bytes [{offset}, "
                f"{offset + nbytes}) overlap another tensor or lie past the data ({data_len} bytes)"
            )
        if offset > at:
            spans.append((at, memoryview(bytearray(offset - at))))
        if nbytes:
            spans.append((offset, writable_bytes(tensors[i])))
        at = offset + nbytes
    if at < data_len:
        spans.append((at, memoryview(bytearray(data_len - at))))
    return spans


def _match(node: dict[str, Any], tgt: Any, matched: list[Any]) -> None:
    """Record, for each tensor of the stored tree, the object at the same place in ``tgt``."""
    if "tensor" in node:
        matched[node["tensor"]] = tgt
    elif "dict" in node:
        tmap = tgt if isinstance(tgt, dict) else {}
        for key, child in node["dict"]:
            _match(child, tmap.get(key), matched)
    else:
        for kind in ("list", "tuple"):
            if kind in node:
                tseq = tgt if isinstance(tgt, (list, tuple)) else ()
                for i, child in enumerate(node[kind]):
                    _match(child, tseq[i] if i < len(tseq) else None, matched)


def _build(node: dict[str, Any], results: list[Any]) -> Any:
    """The state described by the stored tree, with ``results`` for its tensors."""
    if "tensor" in node:
        return results[node["tensor"]]
    if "dict" in node:
        return {key: _build(child, results) for key, child in node["dict"]}
    for kind in ("list", "tuple"):
        if kind in node:
            out = [_build(child, results) for child in node[kind]]
            return out if kind == "list" else tuple(out)
    if "dtype" in node:
        return dtype_from_name(node["dtype"])
    return node["value"]
