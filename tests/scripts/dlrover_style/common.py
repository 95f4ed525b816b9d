"""What the DLRover-style test scripts share that is not part of the style under test: where each
rank records its progress and the final model for the test to compare."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch


def record(out_dir: str, event: str, **fields: Any) -> None:
    """Append one JSON line for this rank and attempt to ``<out>/events.<rank>.jsonl`` (flushed,
    so a SIGKILL right after loses nothing written before it)."""
    rank = int(os.environ.get("RANK", "0"))
    line = json.dumps(
        {
            "event": event,
            "rank": rank,
            "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "pid": os.getpid(),
            **fields,
        }
    )
    with open(os.path.join(out_dir, f"events.{rank}.jsonl"), "a") as f:
        f.write(line + "\n")
        f.flush()


def save_final(out_dir: str, state: dict[str, torch.Tensor]) -> None:
    """Rank 0 writes the final parameters and their digest."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    tensors = {k: v.detach().clone().contiguous() for k, v in state.items()}
    digest = hashlib.sha256()
    for key in sorted(tensors):
        digest.update(key.encode())
        digest.update(tensors[key].numpy().tobytes())
    torch.save(tensors, os.path.join(out_dir, "final.pt"))
    with open(os.path.join(out_dir, "final.sha256"), "w") as f:
        f.write(digest.hexdigest())
