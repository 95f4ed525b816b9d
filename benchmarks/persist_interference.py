"""What slows busy trainers while a checkpoint persists: the write itself, not the persist's CPU.

Two trainer processes (one per CPU, each with a spinning side thread, as in checkpoint.py's
busy rows) keep every core busy; then, in turn, this process does nothing for 1 s, writes
1 GiB with O_DIRECT from one thread (about 0.04 CPU-s), writes it at half the rate (a pause
after each chunk as long as its write), and checksums it with ISA-L (0.05 CPU-s, no I/O).
For each, the trainers' mean step time during it over the second just before, medians of
``--repeats``. Run: ``python benchmarks/persist_interference.py``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.checkpoint import BusyTrainers  # noqa: E402

CHUNK = 16 << 20


def direct_write(data: mmap.mmap, path: str, duty: float = 1.0) -> None:
    """Write ``data`` to ``path`` with O_DIRECT, busy a ``duty`` share of the time."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    try:
        view = memoryview(data)
        for offset in range(0, len(data), CHUNK):
            start = time.monotonic()
            os.pwrite(fd, view[offset : offset + CHUNK], offset)
            if duty < 1:
                time.sleep((time.monotonic() - start) * (1 - duty) / duty)
        os.fsync(fd)
    finally:
        os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the file goes (default: temp dir)")
    args = parser.parse_args()
    from isal import isal_zlib

    nbytes = int(args.size_gb * 2**30) // CHUNK * CHUNK
    data = mmap.mmap(-1, nbytes)
    for offset in range(0, nbytes, CHUNK):
        data[offset : offset + CHUNK] = os.urandom(1 << 20) * (CHUNK >> 20)
    path = os.path.join(args.dir or tempfile.gettempdir(), f"dlrover-interference-{os.getpid()}")
    cases: dict[str, Callable[[], object]] = {
        "nothing (1 s)": lambda: time.sleep(1.0),
        "O_DIRECT write": lambda: direct_write(data, path),
        "O_DIRECT write at half rate": lambda: direct_write(data, path, 0.5),
        "ISA-L CRC-32 (no I/O)": lambda: isal_zlib.crc32(data),
    }
    took: dict[str, list[float]] = {name: [] for name in cases}
    slow: dict[str, list[float]] = {name: [] for name in cases}
    trainers = BusyTrainers(os.cpu_count() or 1)
    try:
        trainers.wait_steps(20)
        for _ in range(args.repeats):
            for name, case in cases.items():
                base0 = time.monotonic()
                time.sleep(1.0)
                t0 = time.monotonic()
                case()
                t1 = time.monotonic()
                before, during = trainers.steps(base0, t0), trainers.steps(t0, t1)
                took[name].append(t1 - t0)
                if before and during:
                    slow[name].append(statistics.mean(during) / statistics.mean(before))
    finally:
        trainers.close()
        if os.path.exists(path):
            os.unlink(path)
    print(
        f"{nbytes / 2**30:.2f} GiB, {os.cpu_count()} cpus busy with trainers, "
        f"{args.repeats} repeats (medians), load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'during':30} {'took s':>7} {'step mean during/before':>24}")
    for name in cases:
        print(
            f"{name:30} {statistics.median(took[name]):7.2f} "
            f"{statistics.median(slow[name]) if slow[name] else float('nan'):24.2f}"
        )


if __name__ == "__main__":
    main()
