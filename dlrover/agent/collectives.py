"""Which collective each rank is in when a job hangs, from PyTorch's flight recorder.

Every worker the agent starts records its collectives in PyTorch's flight recorder (a ring
buffer of the last ``TORCH_FR_BUFFER_SIZE`` collectives in C++, per process group: a sequence
number and the operation; gloo here, NCCL's own on a GPU, through the same interface, and DDP's
gradient all-reduces too, which no Python wrapper sees). The agent sets the buffer's size unless
the user did.

When the agent finds its workers hung, it asks each for a summary (`ask_dump`): a daemon thread
in the worker (`start_dump_thread`, armed by the bootstrap) notices the request within
``POLL_S`` and writes, per process group, the last collective the rank entered. A thread, not a
signal handler: the main thread sits in a collective's wait, in C++, where no Python handler
runs, while the wait releases the GIL. `laggards` then compares the ranks of every node: the
rank whose last collective is behind the others' did not enter the one they wait in
(`dlrover.collectives.laggards`).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from dlrover.collectives import last_per_group
from dlrover.constants import ENV_COLLECTIVES_FILE as ENV_COLLECTIVES_FILE
from dlrover.constants import ENV_FR_BUFFER as ENV_FR_BUFFER

DEFAULT_FR_BUFFER = "2000"
"""What the agent sets unless the user set it: ~100 KB per process, negligible per collective
(`benchmarks/hangs.py` measures it)."""
POLL_S = 0.2
"""How often a worker's dump thread looks for a request (one stat call)."""
ASK_SUFFIX = ".ask"


def start_dump_thread() -> threading.Thread | None:
    """In a worker: answer the agent's requests for a summary (None: not under an agent)."""
    path = os.environ.get(ENV_COLLECTIVES_FILE, "")
    if not path:
        return None
    thread = threading.Thread(target=_serve, args=(path,), name="dlrover-collectives", daemon=True)
    thread.start()
    return thread


def _serve(path: str) -> None:
    ask = path + ASK_SUFFIX
    while True:
        time.sleep(POLL_S)
        if not os.path.exists(ask):
            continue
        try:
            doc = summary()
        except Exception as e:  # never let a dump take the worker down
            doc = {"groups": {}, "error": f"{type(e).__name__}: {e}"}
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
        try:
            os.unlink(ask)
        except FileNotFoundError:
            pass


def summary() -> dict[str, Any]:
    """This process's collectives: per process group, the last one entered (sequence number,
    operation, state) and how many are recorded; empty where torch.distributed is not in use."""
    if "torch.distributed" not in sys.modules:
        return {"groups": {}, "error": "torch.distributed is not in use"}
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return {"groups": {}, "error": "no process group"}
    from torch._C import _distributed_c10d as c10d

    trace = json.loads(c10d._dump_fr_trace_json(True, True))  # type: ignore[attr-defined]
    return {"groups": last_per_group(trace.get("entries", []))}


# --- the agent's side ----------------------------------------------------------------------------
def ask_dump(paths: Mapping[int, str], timeout_s: float = 2.0) -> dict[int, dict[str, Any]]:
    """Ask each worker (rank -> its collectives file) for its summary; rank -> the summary, or
    ``{"groups": {}, "error": ...}`` for one that did not answer within ``timeout_s`` (stopped,
    or holding the GIL in native code)."""
    for path in paths.values():
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        with open(path + ASK_SUFFIX, "w"):
            pass
    out: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    waiting = dict(paths)
    while waiting and time.monotonic() < deadline:
        for rank, path in list(waiting.items()):
            try:
                with open(path) as f:
                    out[rank] = json.load(f)
            except (FileNotFoundError, json.JSONDecodeError):
                continue
            del waiting[rank]
        if waiting:
            time.sleep(0.05)  # polling files the workers write; bounded by the deadline
    for rank in waiting:
        out[rank] = {
            "groups": {},
            "error": f"no answer within {timeout_s:.0f}s (stopped, or holding the GIL)",
        }
    return out
