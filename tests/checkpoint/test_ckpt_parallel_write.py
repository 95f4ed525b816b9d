"""The local persist writes a file from several threads and checksums it while writing: the file
and its CRC must be exactly what a plain sequential write gives."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest

from dlrover.checkpoint import storage as storage_mod
from dlrover.checkpoint.crc import crc32_combine
from dlrover.checkpoint.errors import CheckpointStorageError
from dlrover.checkpoint.storage import FsspecStorage, LocalStorage


@pytest.mark.parametrize("a", [0, 1, 5, 4096, 70_001])
@pytest.mark.parametrize("b", [0, 1, 3, 65_536, 123_457])
def test_crc32_combine_equals_the_crc_of_the_concatenation(a: int, b: int) -> None:
    x, y = os.urandom(a), os.urandom(b)
    assert crc32_combine(zlib.crc32(x), zlib.crc32(y), b) == zlib.crc32(x + y)


@pytest.mark.parametrize("size", [0, 1, 4095, (3 << 20) + 17])
def test_parallel_local_write_gives_the_bytes_and_crc_of_a_sequential_one(
    tmp_path: Path, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storage_mod, "WRITE_CHUNK_BYTES", 1 << 20)  # several chunks per thread
    data = os.urandom(size)
    crc = LocalStorage(str(tmp_path)).write_from("part.bin", memoryview(data))
    assert (tmp_path / "part.bin").read_bytes() == data
    assert crc == zlib.crc32(data)
    # The streaming path (any fsspec URL) agrees.
    memory = FsspecStorage(f"memory://dlrtest-{os.getpid()}-{size}")
    assert memory.write_from("part.bin", memoryview(data)) == crc
    assert memory.read_bytes("part.bin") == data


def test_an_unwritable_place_is_a_clear_storage_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointStorageError, match="cannot write"):
        LocalStorage(str(tmp_path / "missing-dir")).write_from("x.bin", memoryview(b"abc"))


def test_a_page_aligned_mapping_is_written_direct_and_its_unaligned_tail_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shared-memory segment's data (page aligned, any length) goes through O_DIRECT where
    the file system takes it; the bytes and the CRC are the same either way."""
    import mmap

    opened: list[int] = []
    real_open_direct = storage_mod._open_direct

    def spy(path: str) -> int:
        opened.append(real_open_direct(path))
        return opened[-1]

    monkeypatch.setattr(storage_mod, "_open_direct", spy)
    monkeypatch.setattr(storage_mod, "WRITE_CHUNK_BYTES", 1 << 20)
    size = (5 << 20) + 17
    area = mmap.mmap(-1, size + 4096)
    payload = os.urandom(size)
    area[4096 : 4096 + size] = payload
    view = memoryview(area)[4096 : 4096 + size]
    crc = LocalStorage(str(tmp_path)).write_from("seg.bin", view)
    view.release()
    area.close()
    assert (tmp_path / "seg.bin").read_bytes() == payload
    assert crc == zlib.crc32(payload)
    assert len(opened) == 1  # tried; -1 only where this file system refuses O_DIRECT


@pytest.mark.parametrize("size", [0, 1, 4095, (1 << 20) + 3])
def test_the_fast_crc_is_zlibs_crc_chunk_by_chunk(size: int) -> None:
    """Manifests keep zlib's CRC-32: ISA-L's (a dependency, so a persist costs little CPU) must
    give the same value, also carried across chunks and from a memoryview."""
    from dlrover.checkpoint.crc import FAST, crc32

    data = os.urandom(size)
    assert FAST, "isal is a dependency of dlrover: reinstall it (pip install isal)"
    half = size // 2
    assert crc32(data) == zlib.crc32(data)
    assert crc32(memoryview(data)[half:], crc32(data[:half])) == zlib.crc32(data)


def test_the_persist_cpu_share_is_read_from_the_environment() -> None:
    from dlrover.checkpoint.config import ENV_PERSIST_CPU, persist_cpu_from_env

    cpus = len(os.sched_getaffinity(0))
    assert persist_cpu_from_env({}) == pytest.approx(0.05 * cpus)
    assert persist_cpu_from_env({ENV_PERSIST_CPU: "0.5"}) == pytest.approx(0.5 * cpus)
    assert persist_cpu_from_env({ENV_PERSIST_CPU: "0"}) is None
    assert persist_cpu_from_env({ENV_PERSIST_CPU: "1"}) is None
    for bad in ("2", "-0.1", "half"):
        with pytest.raises(ValueError, match=ENV_PERSIST_CPU):
            persist_cpu_from_env({ENV_PERSIST_CPU: bad})


def test_the_pacer_keeps_a_thread_group_under_its_cpu_cap() -> None:
    """On a saturated node (no idle share), threads that burn CPU and charge it are slept
    until their CPU time fits the cap: when they end, the wall time since the start is at
    least their CPU time over the cap."""
    import threading
    import time

    from dlrover.checkpoint.pacer import CpuPacer

    pacer = CpuPacer(0.25, idle_share=lambda: 0.0)
    start = time.monotonic()
    used = [0.0, 0.0]

    def burn(i: int) -> None:
        cpu = begin = time.thread_time()
        for _ in range(10):
            deadline = time.thread_time() + 0.01
            while time.thread_time() < deadline:
                pass
            cpu = pacer.charge(cpu)
        used[i] = cpu - begin

    threads = [threading.Thread(target=burn, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    wall = time.monotonic() - start
    assert sum(used) >= 0.2
    assert wall >= sum(used) / 0.25 * 0.95  # thread_time's resolution: a little slack


def test_the_pacer_lets_a_persist_run_free_while_the_node_has_cpu_to_spare() -> None:
    """The cap binds only while the node is saturated, and idle time builds no credit: after
    a spare spell, a saturated node is paced from then on."""
    from dlrover.checkpoint.pacer import PROBE_EVERY_S, CpuPacer

    now = [0.0]
    spare = [True]
    pacer = CpuPacer(0.1, idle_share=lambda: 0.9 if spare[0] else 0.0, clock=lambda: now[0])
    for _ in range(5):  # 0.05 CPU-s per 0.06 s of wall: far over the cap, but CPU is spare
        now[0] += PROBE_EVERY_S + 0.01
        assert pacer.account(0.05) == 0.0
    spare[0] = False
    now[0] += PROBE_EVERY_S + 0.01
    # Ahead by its CPU over the cap less the wall time since the last spare probe: no credit.
    assert pacer.account(0.05) == pytest.approx(0.05 / 0.1 - (PROBE_EVERY_S + 0.01))
    assert CpuPacer(None, idle_share=lambda: 0.0).account(5.0) == 0.0


def test_the_node_idle_probe_reads_proc_stat(tmp_path: Path) -> None:
    from dlrover.checkpoint.pacer import NodeIdleProbe

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 100 700 100 0 0 0 0 0\ncpu0 1 2 3\n")
    probe = NodeIdleProbe(str(stat))
    stat.write_text("cpu  250 0 150 750 100 0 0 0 0 0\n")  # 250 ticks, 50 of them idle
    assert probe() == pytest.approx(0.2)
    assert NodeIdleProbe(str(tmp_path / "missing"))() == 0.0


def test_a_capped_persist_writes_the_same_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dlrover.checkpoint.config import ENV_PERSIST_CPU

    monkeypatch.setenv(ENV_PERSIST_CPU, "0.05")
    monkeypatch.setattr(storage_mod, "WRITE_CHUNK_BYTES", 1 << 20)
    data = os.urandom((4 << 20) + 5)
    assert LocalStorage(str(tmp_path)).write_from("p.bin", memoryview(data)) == zlib.crc32(data)
    assert (tmp_path / "p.bin").read_bytes() == data
