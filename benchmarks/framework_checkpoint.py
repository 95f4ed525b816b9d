"""What the framework checkpoint benchmarks (deepspeed_checkpoint.py, megatron_checkpoint.py)
share: touching memory first, fsync of the peer's files, and the side-by-side table."""

from __future__ import annotations

import mmap
import os
import statistics
from pathlib import Path


def warm_memory(gib: float) -> None:
    """Touch ``gib`` GiB of memory once and free it. On a virtual machine the host backs a page
    the guest never touched only when it is first written (about 350 MB/s here, against
    2.5 GB/s after): whichever side allocates memory the run has not used yet would pay for
    it. Our persist keeps more steps (and two shared-memory buffers) than a framework's one
    overwritten directory, so without this the first saves measure the host, not the code."""
    if gib <= 0:
        return
    chunk = b"\1" * (64 << 20)
    with mmap.mmap(-1, int(gib * 2**30)) as mem:
        while mem.tell() + len(chunk) <= len(mem):
            mem.write(chunk)


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` (a framework's save leaves them in the page cache)."""
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def print_table(rows: dict[str, list[float]], peer: str, save_row: str, load_row: str) -> None:
    """Each row's median (min-max) and its ratio: saves to ``save_row``, loads (rows whose name
    says "load") to ``load_row``."""
    peers = {"save": statistics.median(rows[save_row]), "load": statistics.median(rows[load_row])}
    width = max(len(name) for name in rows)
    print(f"| {'operation':<{width}} | {'seconds':>22} | {'/ ' + peer:>{len(peer) + 3}} |")
    for name, times in rows.items():
        med = statistics.median(times)
        ratio = med / peers["load" if "load" in name else "save"]
        spread = f"{med:.3f} ({min(times):.3f}-{max(times):.3f})"
        print(f"| {name:<{width}} | {spread:>22} | {ratio:>{len(peer) + 2}.2f}x |")
