"""TensorBoard event files of the job's metrics (`--tensorboard-dir`), without TensorFlow.

An event file is a sequence of TFRecords (``uint64 length, uint32 masked CRC-32C of the length,
data, uint32 masked CRC-32C of the data``), each holding one ``Event`` protobuf: ``wall_time``
(field 1, double), ``step`` (2, int64), ``file_version`` (3, string, the first event) or
``summary`` (5) with ``value`` entries (1) of ``tag`` (1, string) and ``simple_value`` (2,
float). Those few fields are encoded here by hand, so the master needs no TensorFlow or
tensorboard package; TensorBoard reads the files as its own.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path

from dlrover.master.goodput import REASONS
from dlrover.master.job import JobMaster
from dlrover.master.nodes import ALIVE_STATES, NodeState

DEFAULT_EVERY_S = 10.0


class TensorBoardError(Exception):
    """The --tensorboard-dir cannot be written (a setting to fix, not a master elsewhere)."""


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    """The TFRecord's masked CRC of ``data``."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """``data`` framed as one TFRecord."""
    length = struct.pack("<Q", len(data))
    return (
        length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))
    )


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if n:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def event(wall_time: float, step: int, scalars: Mapping[str, float] | None = None) -> bytes:
    """An ``Event`` with ``scalars`` as its summary (none: the file-version event)."""
    out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3 | 0) + _varint(step)
    if scalars is None:
        return out + _bytes_field(3, b"brain.Event:2")
    values = b"".join(
        _bytes_field(
            1,
            _bytes_field(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", value),
        )
        for tag, value in scalars.items()
    )
    return out + _bytes_field(5, values)


class EventFileWriter:
    """Appends scalar events to one new event file in ``directory``."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path = path / name
        self._file = open(self.path, "ab")  # noqa: SIM115 (kept open for the job's life)
        self._lock = threading.Lock()
        self._write(event(time.time(), 0))

    def scalars(
        self, step: int, values: Mapping[str, float], wall_time: float | None = None
    ) -> None:
        """One event of ``values`` at ``step``; flushed, so TensorBoard sees it at once."""
        self._write(event(time.time() if wall_time is None else wall_time, step, values))

    def _write(self, data: bytes) -> None:
        with self._lock:
            self._file.write(record(data))
            self._file.flush()

    def close(self) -> None:
        """Close the file."""
        with self._lock:
            self._file.close()


class TensorBoardExporter:
    """Writes the job's metrics every ``every_s`` (goodput, badput, steps, nodes, usage; a
    TensorFlow job's role nodes and throughput)."""

    def __init__(self, job: JobMaster, directory: str, every_s: float = DEFAULT_EVERY_S) -> None:
        self._job = job
        self._every_s = every_s
        self._next = 0.0
        self.writer = EventFileWriter(directory)

    def maybe_write(self, now: float) -> None:
        """Write a point if ``every_s`` passed since the last one."""
        if now < self._next:
            return
        self._next = now + self._every_s
        self.write(now)

    def write(self, now: float) -> None:
        """Write one point of every scalar now."""
        job = self._job
        g = job.diagnostics.goodput.snapshot(now)
        values = {
            "goodput/ratio": g.ratio,
            "goodput/productive_seconds": g.productive_s,
            "job/step_seconds": g.step_s,
            **{f"badput/{reason}_seconds": g.badput_s[reason] for reason in REASONS},
        }
        nodes = job.members.nodes.all()
        by_state = Counter(n.state for n in nodes)
        # Every state, 0 where no node is in it: a series that is only written while it is
        # non-zero would stay at its last count in TensorBoard (as metrics.py does).
        values.update({f"nodes/{state.value}": float(by_state[state]) for state in NodeState})
        for n in nodes:
            if n.state in ALIVE_STATES:
                values[f"node/{n.node_id}/cpu_percent"] = n.cpu_percent
                values[f"node/{n.node_id}/memory_mib"] = n.memory_bytes / 2**20
        # A TensorFlow job's roles and throughput; its step is the chief's batches.
        for r in job.roles.role_nodes():
            if r.state in ("pending", "running"):
                values[f"node/{r.node_id}/cpu_percent"] = r.cpu_percent
                values[f"node/{r.node_id}/memory_mib"] = r.memory_bytes / 2**20
        rates = job.roles.rates()
        if rates.steps:
            values["job/steps_per_second"] = rates.steps_per_s
            values["job/samples_per_second"] = rates.samples_per_s
        self.writer.scalars(g.steps or rates.steps, values)

    def close(self) -> None:
        """Write a last point and close the file."""
        self.write(self._job.clock())
        self.writer.close()
