"""Load a step stored in the torch.distributed.checkpoint (DCP) format into a state dict."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata


def load_dcp(url: str, target: dict[str, Any]) -> None:
    """Fill ``target`` (its sharded tensors, in place) from the DCP step at ``url``, adding the
    saved ``extra.*`` entries under ``target["extra"]``."""
    target["extra"] = _extra_target(url)
    # FSDP1 gives a rank no part of a tensor smaller than the world (a Linear(d, 1)
    # head): DCP cannot load such an entry, and there is nothing to load into it.
    removed = _pop_empty_shards(target)
    try:
        dcp.load(target, checkpoint_id=url)
    finally:
        for node, key, value in removed:
            node[key] = value


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
