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


@pytest.mark.parametrize("where", ["disk", "tmpfs"])
@pytest.mark.parametrize("pieces", [[], [1], [4095, 1, 70_000], [(3 << 20) + 5, 17, 1 << 20]])
def test_a_streamed_write_gives_the_bytes_and_crc_of_a_sequential_one(
    tmp_path: Path, where: str, pieces: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Storage.stream`` (torch.save writes into it piece by piece): page-aligned chunks
    written with O_DIRECT on a disk, buffered on tmpfs (which refuses O_DIRECT)."""
    monkeypatch.setattr(storage_mod, "STREAM_CHUNK_BYTES", 1 << 20)  # several chunks
    root = tmp_path if where == "disk" else Path("/dev/shm")
    if not root.is_dir():
        pytest.skip("no /dev/shm here")
    storage = LocalStorage(str(root))
    name = f"dlrtest-stream-{os.getpid()}-{len(pieces)}.bin"
    parts = [os.urandom(n) for n in pieces]
    try:
        with storage.stream(name) as sink:
            for part in parts:
                assert sink.write(part) == len(part)
        data = b"".join(parts)
        assert (root / name).read_bytes() == data
        assert (sink.size, sink.crc) == (len(data), zlib.crc32(data))
        memory = FsspecStorage(f"memory://dlrtest-stream-{os.getpid()}-{len(pieces)}")
        with memory.stream("part.bin") as other:
            for part in parts:
                other.write(part)
        assert (other.crc, memory.read_bytes("part.bin")) == (sink.crc, data)
    finally:
        (root / name).unlink(missing_ok=True)


def test_a_streamed_write_that_fails_is_a_clear_storage_error(tmp_path: Path) -> None:
    storage = LocalStorage(str(tmp_path / "missing"))
    with pytest.raises(CheckpointStorageError, match="cannot write"), storage.stream("x.bin") as s:
        s.write(b"x")
