"""TensorBoard event files written without TensorFlow: framing, CRCs and protobuf encoding,
read back by TensorBoard itself where it is installed (CI's extras stage)."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path

import pytest

from dlrover.api.master import Registration
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.nodes import NodeState
from dlrover.master.rendezvous import RendezvousConfig
from dlrover.master.state_store import MemoryStateStore
from dlrover.master.tensorboard import EventFileWriter, TensorBoardExporter, crc32c, masked_crc


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


def _scalar(event: bytes, tag: str) -> float | None:
    """The value of ``tag`` in an event written by `event` (None: not in it)."""
    name = tag.encode()
    at = event.find(b"\x0a" + bytes([len(name)]) + name)
    if at < 0:
        return None
    at += 2 + len(name)
    assert event[at] == 0x15  # simple_value: field 2, 32-bit
    return float(struct.unpack_from("<f", event, at + 1)[0])


def _job() -> JobMaster:
    job = JobMaster(JobMasterConfig("tb", RendezvousConfig(1, 1)), MemoryStateStore())
    job.members.register_node(Registration("h", 1, "n0", "default", -1, 1))
    return job


def test_node_state_series_go_back_to_zero(tmp_path: Path) -> None:
    """Every node state is written at every point, 0 where no node is in it: a node that left
    PENDING must not stay a pending node in TensorBoard."""
    job = _job()
    exporter = TensorBoardExporter(job, str(tmp_path))
    exporter.write(job.clock())
    job.members.lose("n0", "gone")
    exporter.write(job.clock())
    exporter.writer.close()
    _, before, after = _records(exporter.writer.path)
    assert _scalar(before, "nodes/pending") == 1.0 and _scalar(before, "nodes/lost") == 0.0
    assert _scalar(after, "nodes/pending") == 0.0 and _scalar(after, "nodes/lost") == 1.0
    assert all(_scalar(after, f"nodes/{s.value}") is not None for s in NodeState)


def test_a_failing_tick_hook_does_not_skip_the_jobs_work(caplog: pytest.LogCaptureFixture) -> None:
    """A hook that raises (the TensorBoard writer on a full disk) is logged; the tick still
    decides the job's end, and the other hooks still run."""
    job = _job()
    calls: list[str] = []

    def full_disk(now: float) -> None:
        calls.append("full disk")
        raise OSError(28, "No space left on device")

    job.add_tick_hook(full_disk)
    job.add_tick_hook(lambda now: calls.append("next"))
    job.members.lose("n0", "gone")
    job.tick()
    assert job.lifecycle.ended.is_set() and job.lifecycle.reason == "every node was lost"
    assert calls == ["full disk", "next"]
    assert "tick hook" in caplog.text and "No space left on device" in caplog.text


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
