"""The agent's persist of Megatron-LM's ``torch_dist`` checkpoints (megatron.core's
``dist_checkpointing``) from shared memory: the sharded tensors and objects as the DCP files
megatron.core writes, rank 0's common state as ``common.pt``, and ``metadata.json``."""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem

from dlrover.checkpoint.catalog import Catalog, FileTable
from dlrover.checkpoint.crc import crc32
from dlrover.checkpoint.dcp_writer import (
    WriteItems,
    bytes_item,
    persist_dcp,
    shard_item,
    write_dcp_metadata,
)
from dlrover.checkpoint.layout import rebuild
from dlrover.checkpoint.object_codec import decode_objects
from dlrover.checkpoint.shm import SharedSegment
from dlrover.checkpoint.torch_files import persist_torch_files, segment_viewer

# What a saving rank copies into its segment (besides the torch-files keys, which hold
# ``common.pt``, persisted by global rank 0 alone):
#   {"torch_dist": {
#       "tensors": [{"key": k, "offset": [...], "global_shape": [...], "main": bool,
#                    "data": <the local chunk>}, ...],
#       "objects": [{"key": <unique key>, "main": bool, "data": [<object data>, ...]}, ...]}}
# Every rank keeps every tensor and object it holds (replicas too: a restarted rank loads all of
# them from its own memory); only main replicas (replica id 0) are written, as megatron.core
# writes them, each chunk under its key at its global offset, each object under its unique key
# as ``torch.save`` of the list of its data.
TORCH_DIST_KEY = "torch_dist"
COMMON_FILE = "common.pt"
METADATA_FILE = "metadata.json"
CONFIG = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
"""``metadata.json`` as megatron.core writes it (its loader checks the backends and versions)."""


def _torch_dist_items(rank: int, meta: dict[str, Any], seg: SharedSegment) -> WriteItems:
    """The main replicas of one rank's chunks and objects, as megatron.core's save writes them."""
    del rank  # each part says itself whether it is written (its main replica)
    state = rebuild(meta, None, segment_viewer(seg))[TORCH_DIST_KEY]
    items: list[WriteItem] = []
    payload: dict[MetadataIndex, torch.Tensor | io.BytesIO] = {}
    for part in state["tensors"]:
        if not part["main"]:
            continue
        data: torch.Tensor = part["data"]
        item = shard_item(
            part["key"], part["offset"], list(data.shape), part["global_shape"], data.dtype
        )
        items.append(item)
        payload[item.index] = data
    grouped: dict[str, list[Any]] = {}
    for part in state["objects"]:
        if part["main"]:
            grouped.setdefault(part["key"], []).append(decode_objects(part["data"]))
    for key, datas in grouped.items():
        buf = io.BytesIO()
        torch.save(datas, buf)  # megatron.core's: the list of the rank's objects of that key
        item = bytes_item(key, buf)
        items.append(item)
        payload[item.index] = buf
    return items, payload


def persist_torch_dist(
    catalog: Catalog, step: int, ranks: Mapping[int, int], segs: dict[int, SharedSegment]
) -> tuple[FileTable, dict[str, Any]]:
    """Write this node's slots' parts of ``step`` (``ranks``: slot -> global rank): their
    ``common.pt`` (rank 0's) and their DCP data files; returns the files and the JSON the
    committer merges into ``.metadata``."""
    files = persist_torch_files(catalog, step, ranks, segs)
    written, doc = persist_dcp(
        catalog, step, {ranks[s]: seg for s, seg in segs.items()}, _torch_dist_items
    )
    files.update(written)
    return files, doc


def finish_torch_dist(catalog: Catalog, step: int, node_docs: list[dict[str, Any]]) -> FileTable:
    """The committer's part: ``.metadata`` from every node's chunks, then ``metadata.json``
    (megatron.core writes it last too: its presence marks a distributed checkpoint)."""
    files = write_dcp_metadata(catalog, step, node_docs)
    config = json.dumps(CONFIG).encode()
    catalog.storage.write_atomic(f"{catalog.step_dir(step)}/{METADATA_FILE}", config)
    files[METADATA_FILE] = {"size": len(config), "crc32": crc32(config)}
    return files
