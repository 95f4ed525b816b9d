"""CPU-seconds per unit of work, summed over every process a data path touches.

Wall-clock ratios cannot separate a path's cost on a 2-core machine where the peer alone fills
both cores; CPU-seconds per record (per id, per GiB, per call) are the same on 2 cores as on
64, and are what a cluster bills. ``CpuAccount({"trainer": os.getpid(), "master": pid, ...})``
reads each process's user + system time (every thread of it) from /proc, before and after a
measured pass; ``cpu_table`` prints the figures per unit, each row next to the peer's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU-seconds of every thread of process ``pid`` so far (/proc/PID/stat);
    0.0 for a process that is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    # After the command: state is fields[0]; utime and stime are the 14th and 15th fields of
    # the line, so [11] and [12] here.
    return (int(fields[11]) + int(fields[12])) / _TICK


class CpuAccount:
    """The CPU-seconds each named process spends while a ``with account.measure() as used:``
    block runs (``used`` is filled in when the block ends)."""

    def __init__(self, processes: Mapping[str, int]) -> None:
        self.processes = dict(processes)

    @contextmanager
    def measure(self) -> Iterator[dict[str, float]]:
        """Yields a dict that holds, after the block, each process's CPU-seconds in it."""
        before = {name: cpu_seconds(pid) for name, pid in self.processes.items()}
        used: dict[str, float] = {}
        try:
            yield used
        finally:
            for name, pid in self.processes.items():
                used[name] = cpu_seconds(pid) - before[name]


def cpu_table(rows: Mapping[str, Mapping[str, float]], work: float, unit: str, peer: str) -> str:
    """A markdown table: per row (a way of doing the work), the CPU-seconds of each process
    per ``unit`` (``work`` units were done in each row's pass), their total, and the total
    against row ``peer``'s. A process a row did not touch shows as '-'."""
    names: list[str] = []
    for used in rows.values():
        names += [name for name in used if name not in names]
    widths = [max(9, len(n)) for n in names]
    head = f"| CPU-s per {unit:<34} | " + " | ".join(
        f"{n:>{w}}" for n, w in zip(names, widths, strict=True)
    )
    lines = [head + f" | {'total':>9} | {'vs ' + peer[:10]:>13} |"]
    lines.append("|" + "---|" * (len(names) + 3))
    peer_total = sum(rows[peer].values()) / work
    for row, used in rows.items():
        cells = [
            f"{used[n] / work:{w}.3f}" if n in used else f"{'-':>{w}}"
            for n, w in zip(names, widths, strict=True)
        ]
        total = sum(used.values()) / work
        ratio = total / peer_total if peer_total else float("nan")
        lines.append(f"| {row:<44} | " + " | ".join(cells) + f" | {total:9.3f} | {ratio:13.2f} |")
    return "\n".join(lines)
