"""The agent's persist of a framework's own checkpoint files (torch.save) from shared memory."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from typing import IO, Any, cast

import torch

from dlrover.checkpoint.catalog import Catalog, FileTable
from dlrover.checkpoint.errors import CheckpointError, SegmentStateError
from dlrover.checkpoint.header import HEADER_SIZE, read_metadata, read_seq
from dlrover.checkpoint.layout import dtype_from_name, rebuild
from dlrover.checkpoint.object_codec import decode_objects
from dlrover.checkpoint.shm import SharedSegment

# What a saving rank copies into its segment (a "torch files" state):
#   {"files": {<name relative to the step directory>: <what torch.save writes there>},
#    "persist": [<the names this rank writes to storage>],
#    "tag": <the step directory's name, where the user named it (DeepSpeed's tag)>, ...}
# Every rank keeps, in memory, every file it needs to load (so a restarted rank loads from its
# own slot), and persists only those its framework would have written from that rank.
FILES_KEY = "files"
PERSIST_KEY = "persist"


def check_file_name(name: str) -> str:
    """``name`` if it is a plain relative path inside a step directory; CheckpointError if not
    (an absolute path or a ``..`` would write outside the step)."""
    norm = posixpath.normpath(name)
    if not name or norm != name or name.startswith("/") or norm.split("/")[0] == "..":
        raise CheckpointError(
            f"checkpoint file name {name!r} is not a path inside a step directory"
        )
    return name


def persist_torch_files(
    catalog: Catalog, step: int, ranks: Mapping[int, int], segs: dict[int, SharedSegment]
) -> FileTable:
    """Write each slot's files named in its ``persist`` list with ``torch.save`` into the step
    directory, their tensors read straight from the segment (no copy of the state first). A
    step saved under a tag goes to the tag's directory (recorded in the catalog first)."""
    states: dict[int, tuple[int, Any]] = {}
    for slot, seg in segs.items():
        seq, meta = read_metadata(seg)
        if meta["step"] != step:
            raise CheckpointError(f"slot {slot} (rank {ranks[slot]}) moved on from step {step}")
        states[slot] = seq, rebuild(meta, None, segment_viewer(seg))
    tags = {str(state["tag"]) for _, state in states.values() if state.get("tag")}
    if len(tags) > 1:
        raise CheckpointError(f"the ranks of step {step} name it differently: {sorted(tags)}")
    if tags and catalog.naming.tagged and (tag := tags.pop()) != catalog.naming.dir(step):
        catalog.name_step(step, tag)
    rel_dir = catalog.step_dir(step)
    catalog.storage.makedirs(rel_dir)
    files: FileTable = {}
    for slot, seg in segs.items():
        seq, state = states[slot]
        for name in state.get(PERSIST_KEY, []):
            check_file_name(name)
            if name in files:
                raise CheckpointError(f"two ranks of step {step} write {name}")
            parent = posixpath.dirname(name)
            if parent:
                catalog.storage.makedirs(f"{rel_dir}/{parent}")
            # Serialized straight into the file (no in-memory copy of it first), checksummed
            # as it goes: the write is what a torch.save of the framework's own costs.
            with catalog.storage.stream(f"{rel_dir}/{name}") as sink:
                # torch.save needs only ``write`` of a file object: the sink's
                torch.save(decode_objects(state[FILES_KEY][name]), cast(IO[bytes], sink))
            files[name] = {"size": sink.size, "crc32": sink.crc}
        if read_seq(seg) != seq:
            raise SegmentStateError(f"segment {seg.path} was overwritten during the persist")
    return files


def segment_viewer(seg: SharedSegment) -> Any:
    """A tensor placer whose tensors own exactly their bytes of the mapping (torch.save writes
    a tensor's whole storage: a view into the segment's one big tensor would write all of it)."""

    def place(index: int, entry: dict[str, Any], tgt: Any) -> torch.Tensor:
        dtype = dtype_from_name(entry["dtype"])
        if not entry["nbytes"]:
            return torch.empty(entry["shape"], dtype=dtype)
        raw = torch.frombuffer(
            seg.buffer,
            dtype=torch.uint8,
            count=entry["nbytes"],
            offset=HEADER_SIZE + entry["offset"],
        )
        return raw.view(dtype).view(entry["shape"])

    return place
