"""Persist sharded segments in the torch.distributed.checkpoint (DCP) format, from the agent."""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult

from dlrover.checkpoint.catalog import Catalog, FileTable, crc32_file
from dlrover.checkpoint.errors import CheckpointError, SegmentStateError
from dlrover.checkpoint.header import read_metadata, read_seq
from dlrover.checkpoint.layout import decode, dtype_from_name, dtype_name, tensor_view
from dlrover.checkpoint.shm import SharedSegment
from dlrover.checkpoint.storage import Storage, StreamSink

# Each saving rank r of the node gets its own DCP plan with storage prefix "__r_", so files of
# different ranks and nodes never collide. The global .metadata needs every rank's chunks and
# file offsets: each node stores them as JSON in its node part, and the committing node merges
# them and writes .metadata through FileSystemWriter.finish (DCP's own encoding of that file).


def dcp_leaves(tree: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(fqn, node) of every leaf, flattened the way DCP's default planner flattens a state
    dict: mappings always, lists only if they contain tensors or mappings; keys joined by '.'."""
    out: list[tuple[str, dict[str, Any]]] = []

    def terminal(node: dict[str, Any]) -> bool:
        if "dict" in node:
            return False
        if "list" not in node:
            return True
        return not any(
            "dict" in c or "tensor" in c or ("list" in c and not terminal(c)) for c in node["list"]
        )

    def walk(path: tuple[str, ...], node: dict[str, Any]) -> None:
        if "dict" in node:
            for key, child in node["dict"]:
                walk(path + (str(key),), child)
        elif terminal(node):
            out.append((".".join(path), node))
        else:
            for i, child in enumerate(node["list"]):
                walk(path + (str(i),), child)

    walk((), tree)
    return out


class _SegmentPlanner(SavePlanner):
    """Only ``resolve_data`` is used: FileSystemWriter.write_data asks it for each item."""

    def __init__(self, data: dict[MetadataIndex, torch.Tensor | io.BytesIO]) -> None:
        self._data = data

    def set_up_planner(
        self, state_dict: Any, storage_meta: StorageMeta | None = None, is_coordinator: bool = False
    ) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        raise NotImplementedError

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        raise NotImplementedError

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        return self._data[write_item.index]


WriteItems = tuple[list[WriteItem], dict[MetadataIndex, torch.Tensor | io.BytesIO]]
"""A rank's DCP write items and, by index, what each writes (a tensor, or serialized bytes)."""

ItemsOf = Callable[[int, dict[str, Any], SharedSegment], WriteItems]
"""``items_of(rank, segment metadata, segment)``: what one rank's segment writes."""


def shard_item(
    fqn: str,
    offsets: list[int],
    shape: list[int],
    global_shape: list[int] | None,
    dtype: torch.dtype,
) -> WriteItem:
    """The write item of one tensor chunk (a shard of a global tensor, or a whole tensor where
    ``global_shape`` is None)."""
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(offsets)),
        type=WriteItemType.TENSOR if global_shape is None else WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(shape)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(shape if global_shape is None else global_shape),
        ),
    )


def bytes_item(fqn: str, buf: io.BytesIO) -> WriteItem:
    """The write item of serialized bytes (``buf``) under ``fqn``."""
    return WriteItem(
        index=MetadataIndex(fqn),
        type=WriteItemType.BYTE_IO,
        bytes_io_data=BytesIOWriteData(buf.getbuffer().nbytes),
    )


def _items_of(rank: int, meta: dict[str, Any], seg: SharedSegment) -> WriteItems:
    """Write items of one rank: its DTensor shards; plain tensors and values from rank 0 only
    (they are replicated, so one copy is enough)."""
    data = seg.tensor
    items: list[WriteItem] = []
    payload: dict[MetadataIndex, torch.Tensor | io.BytesIO] = {}
    for fqn, node in dcp_leaves(meta["tree"]):
        if "tensor" in node:
            entry = meta["tensors"][node["tensor"]]
            if entry.get("empty_shard"):
                continue  # a ShardedTensor this rank holds no part of
            if "global_shape" not in entry and rank != 0:
                continue
            item = shard_item(
                fqn,
                entry.get("chunk_offsets", [0] * len(entry["shape"])),
                entry["shape"],
                entry.get("global_shape"),
                dtype_from_name(entry["dtype"]),
            )
            items.append(item)
            payload[item.index] = tensor_view(data, entry)
        elif rank == 0:
            buf = io.BytesIO()
            torch.save(decode({"tree": node, "tensors": []}, data), buf)
            items.append(bytes_item(fqn, buf))
            payload[items[-1].index] = buf
    return items, payload


def persist_dcp(
    catalog: Catalog,
    step: int,
    segments: dict[int, SharedSegment],
    items_of: ItemsOf = _items_of,
) -> tuple[FileTable, dict[str, Any]]:
    """Write the DCP data files of every rank in ``segments`` (global rank -> segment), each
    rank's items as ``items_of`` finds them in its segment (default: the tree's tensors by
    their path, as DCP's default planner names them).

    Returns the files written (for the node part) and the JSON the committer needs to build
    the global .metadata.
    """
    rel = catalog.step_dir(step)
    catalog.storage.makedirs(rel)
    # Durable through the storage's own stream (fsynced when each file ends), not DCP's fsync.
    writer = FileSystemWriter(catalog.storage.url(rel), sync_files=False, overwrite=True)
    streams = _StorageStreams(catalog.storage, rel)
    writer.fs = streams
    writer.set_up_storage_writer(True)
    world = None
    metas: dict[int, tuple[int, dict[str, Any]]] = {}
    for rank, seg in segments.items():
        seq, meta = read_metadata(seg)
        if meta["step"] != step:
            raise CheckpointError(f"rank {rank}'s segment holds step {meta['step']}, not {step}")
        world = meta["world_size"]
        metas[rank] = (seq, meta)
    assert world is not None
    results: list[dict[str, Any]] = []
    chunks: dict[str, Any] = {}
    files: FileTable = {}
    for rank, (seq, meta) in sorted(metas.items()):
        seg = segments[rank]
        items, payload = items_of(rank, meta, seg)
        plans = writer.prepare_global_plan([SavePlan([]) for _ in range(world)])
        plan = SavePlan(items, storage_data=plans[rank].storage_data)
        written: list[WriteResult] = writer.write_data(plan, _SegmentPlanner(payload)).wait()
        if read_seq(seg) != seq:
            raise SegmentStateError(f"segment {seg.path} was overwritten during the persist")
        for item in items:
            fqn = item.index.fqn
            if item.tensor_data is None:
                chunks[fqn] = {"bytes": True}
                continue
            td = item.tensor_data
            desc = chunks.setdefault(
                fqn, {"dtype": dtype_name(td.properties.dtype), "size": list(td.size), "chunks": []}
            )
            desc["chunks"].append([list(td.chunk.offsets), list(td.chunk.sizes)])
        for wr in written:
            info = wr.storage_data
            results.append(
                {
                    "fqn": wr.index.fqn,
                    "offset": None if wr.index.offset is None else list(wr.index.offset),
                    "size": wr.size_in_bytes,
                    "path": info.relative_path,
                    "at": info.offset,
                    "len": info.length,
                }
            )
    for name in sorted({r["path"] for r in results}):
        size, crc = streams.written[name]
        files[name] = {"size": size, "crc32": crc}
    return files, {"chunks": chunks, "results": results}


class _StorageStreams(FileSystem):
    """DCP's local file system, its data files written through ``Storage.stream``: with
    O_DIRECT where the storage can (no page-cache churn), fsynced when each file ends, and
    checksummed as written (no second read of the files for the manifest)."""

    def __init__(self, storage: Storage, rel_dir: str) -> None:
        super().__init__()
        self._storage = storage
        self._rel = rel_dir
        self.written: dict[str, tuple[int, int]] = {}
        """(size, CRC-32) of each file written, by name."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = os.path.basename(os.fspath(path))
        with self._storage.stream(f"{self._rel}/{name}") as sink:
            yield _Telling(sink)
        self.written[name] = (sink.size, sink.crc)


class _Telling:
    """A stream sink with the ``tell`` DCP asks for (where each item starts: bytes so far)."""

    def __init__(self, sink: StreamSink) -> None:
        self._sink = sink

    def write(self, data: bytes | bytearray | memoryview) -> int:
        return self._sink.write(data)

    def tell(self) -> int:
        return self._sink.size

    def flush(self) -> None:
        self._sink.flush()

    def close(self) -> None:
        """Nothing to do: the storage's stream ends (and is fsynced) with its block."""


def write_dcp_metadata(catalog: Catalog, step: int, node_docs: list[dict[str, Any]]) -> FileTable:
    """Merge every node's DCP part into the global .metadata file; returns its file entry."""
    # _StorageInfo is the record DCP keeps per item in .metadata; FileSystemReader needs it.
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    state_md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    results: list[WriteResult] = []
    for extra in node_docs:
        doc = extra["dcp"]
        for fqn, desc in doc["chunks"].items():
            if desc.get("bytes"):
                state_md[fqn] = BytesStorageMetadata()
                continue
            md = state_md.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                md = TensorStorageMetadata(
                    TensorProperties(dtype=dtype_from_name(desc["dtype"])),
                    torch.Size(desc["size"]),
                    [],
                )
                state_md[fqn] = md
            md.chunks.extend(
                ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in desc["chunks"]
            )
        for r in doc["results"]:
            offset = None if r["offset"] is None else torch.Size(r["offset"])
            results.append(
                WriteResult(
                    MetadataIndex(r["fqn"], offset),
                    r["size"],
                    _StorageInfo(r["path"], r["at"], r["len"]),
                )
            )
    rel = catalog.step_dir(step)
    writer = FileSystemWriter(catalog.storage.url(rel), sync_files=True, overwrite=True)
    writer.set_up_storage_writer(True)
    writer.finish(Metadata(state_dict_metadata=dict(state_md)), [results])
    size, crc = crc32_file(catalog.storage, f"{rel}/.metadata")
    return {".metadata": {"size": size, "crc32": crc}}
