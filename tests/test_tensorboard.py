"""TensorBoard event files written without TensorFlow: framing, CRCs and protobuf encoding,
read back by TensorBoard itself where it is installed (CI's extras stage)."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import pytest

from dlrover.master.tensorboard import EventFileWriter, crc32c, masked_crc


def test_crc32c_check_value() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value
    assert crc32c(b"") == 0


def _records(path: Path) -> list[bytes]:
    data, out, at = path.read_bytes(), [], 0
    while at < len(data):
        (length,) = struct.unpack_from("<Q", data, at)
        (len_crc,) = struct.unpack_from("<I", data, at + 8)
        assert len_crc == masked_crc(data[at : at + 8])
        body = data[at + 12 : at + 12 + length]
        (body_crc,) = struct.unpack_from("<I", data, at + 12 + length)
        assert body_crc == masked_crc(body)
        out.append(body)
        at += 12 + length + 4
    return out


def test_event_file_records_are_framed_and_checksummed(tmp_path: Path) -> None:
    w = EventFileWriter(tmp_path)
    w.scalars(7, {"goodput/ratio": 0.5, "job/step_seconds": 0.25}, wall_time=1000.0)
    w.close()
    assert w.path.name.startswith("events.out.tfevents.")
    first, second = _records(w.path)
    assert b"brain.Event:2" in first
    # wall_time (field 1, double), step (field 2, varint 7), then the summary (field 5)
    assert second[:9] == b"\x09" + struct.pack("<d", 1000.0) and second[9:11] == b"\x10\x07"
    assert b"goodput/ratio" in second and struct.pack("<f", 0.5) in second


@pytest.mark.extras
@pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None, reason="pip install tensorboard"
)
def test_tensorboard_reads_the_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    w = EventFileWriter(tmp_path)
    for step in (1, 2, 3):
        w.scalars(step, {"goodput/ratio": step / 4, "badput/restart_seconds": float(step)})
    w.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"goodput/ratio", "badput/restart_seconds"}
    ratio = acc.Scalars("goodput/ratio")
    assert [(e.step, e.value) for e in ratio] == [(1, 0.25), (2, 0.5), (3, 0.75)]
