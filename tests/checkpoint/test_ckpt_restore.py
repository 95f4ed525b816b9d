"""Restore from storage: one read straight into the target, checksummed as it reads, and a
corrupt or short step still detected and the previous complete one loaded."""

from __future__ import annotations

import json
import logging
import os
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dlrover.checkpoint.catalog import Catalog
from dlrover.checkpoint.config import ENV_CHECKPOINT_SOCKET
from dlrover.checkpoint.errors import CheckpointCorruptError
from dlrover.checkpoint.read_ranges import MIN_PARALLEL_BYTES, checksum_file, read_spans
from dlrover.checkpoint.storage import FsspecStorage, LocalStorage
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer


def big_state(step: int) -> dict[str, Any]:
    """Over MIN_PARALLEL_BYTES, so the file is read by several threads; odd sizes leave
    alignment gaps between the tensors."""
    g = torch.Generator().manual_seed(step)
    model = {f"w{i}": torch.randn(1_000_003 + i, generator=g) for i in range(12)}
    model["half"] = torch.randn(333, 7, generator=g).to(torch.bfloat16)
    model["tied"] = model["tied_too"] = torch.randn(4099, generator=g)  # tied weights
    return {"model": model, "step": step, "names": ["a", ("b", 1)]}


def fresh_target() -> dict[str, Any]:
    state = big_state(999)
    return {"model": state["model"]}


def assert_state(expected: dict[str, Any], got: dict[str, Any]) -> None:
    assert got["step"] == expected["step"] and got["names"] == expected["names"]
    assert got["model"].keys() == expected["model"].keys()
    for key, tensor in expected["model"].items():
        assert torch.equal(got["model"][key], tensor), key


@pytest.fixture
def saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[DdpCheckpointer, Path]]:
    """Steps 1 and 2 of big_state persisted by an in-process saver."""
    monkeypatch.delenv(ENV_CHECKPOINT_SOCKET, raising=False)
    ckpt = DdpCheckpointer(str(tmp_path / "ckpt"))
    try:
        for step in (1, 2):
            assert ckpt.save_checkpoint(step, big_state(step))
            assert ckpt.wait_latest_checkpoint(60)
        assert (tmp_path / "ckpt" / "step_2" / "rank_0.bin").stat().st_size > MIN_PARALLEL_BYTES
        yield ckpt, tmp_path / "ckpt"
    finally:
        ckpt.close()


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_load_reads_straight_into_the_target_s_tensors(
    saved: tuple[DdpCheckpointer, Path],
) -> None:
    ckpt, _ = saved
    target = fresh_target()
    before = {k: t.data_ptr() for k, t in target["model"].items()}
    state = ckpt.load_checkpoint(target=target)
    assert ckpt.last_load_source == "storage"
    assert_state(big_state(2), state)
    assert {k: t.data_ptr() for k, t in state["model"].items()} == before
    assert_state(big_state(2), ckpt.load_checkpoint())  # no target: fresh tensors


def test_a_bit_flipped_in_the_last_range_falls_back_and_rewrites_the_target(
    saved: tuple[DdpCheckpointer, Path], caplog: pytest.LogCaptureFixture
) -> None:
    ckpt, root = saved
    data = root / "step_2" / "rank_0.bin"
    flip(data, data.stat().st_size - 4096)  # read by the last thread, after the others
    target = fresh_target()
    with caplog.at_level(logging.WARNING):
        state = ckpt.load_checkpoint(target=target)
    assert "step 2 is unusable" in caplog.text and "rank_0.bin is corrupt" in caplog.text
    assert_state(big_state(1), state)
    # Step 2's bytes landed in the target before the check failed; step 1 overwrote them all.
    assert_state(big_state(1), {**state, "model": target["model"]})
    assert data.exists()  # nothing deleted: an operator can still inspect it


def test_a_short_file_is_refused_before_the_target_is_touched(
    saved: tuple[DdpCheckpointer, Path], caplog: pytest.LogCaptureFixture
) -> None:
    ckpt, root = saved
    data = root / "step_2" / "rank_0.bin"
    os.truncate(data, data.stat().st_size - 1)
    target = fresh_target()
    untouched = {k: t.clone() for k, t in target["model"].items()}
    catalog = Catalog(LocalStorage(str(root)))
    with pytest.raises(CheckpointCorruptError, match="rank_0.bin is corrupt"):
        catalog.load_plain_part(2, "rank_0", target)
    assert all(torch.equal(target["model"][k], t) for k, t in untouched.items())
    with caplog.at_level(logging.WARNING):
        assert_state(big_state(1), ckpt.load_checkpoint(target=target))
    assert "step 2 is unusable" in caplog.text


def test_a_corrupt_metadata_file_is_detected(saved: tuple[DdpCheckpointer, Path]) -> None:
    ckpt, root = saved
    meta = root / "step_2" / "rank_0.meta.json"
    doc = json.loads(meta.read_text())
    doc["tensors"][0]["offset"] += 64  # still JSON, but not what was written
    meta.write_text(json.dumps(doc))
    assert_state(big_state(1), ckpt.load_checkpoint(target=fresh_target()))


def test_no_intact_step_after_writing_into_the_target_is_a_clear_error(
    saved: tuple[DdpCheckpointer, Path],
) -> None:
    ckpt, root = saved
    for step in (1, 2):
        flip(root / f"step_{step}" / "rank_0.bin", 8192)
    with pytest.raises(CheckpointCorruptError, match="no committed step .* is intact.*rebuild"):
        ckpt.load_checkpoint(target=fresh_target())
    assert ckpt.load_checkpoint() == {}  # without a target nothing was overwritten: none found


def test_tied_and_non_contiguous_targets_are_filled_too(
    saved: tuple[DdpCheckpointer, Path],
) -> None:
    ckpt, _ = saved
    target = fresh_target()
    target["model"]["tied_too"] = target["model"]["tied"]  # one memory for two entries
    target["model"]["half"] = torch.empty(7, 333, dtype=torch.bfloat16).t()
    assert not target["model"]["half"].is_contiguous()
    state = ckpt.load_checkpoint(target=target)
    assert_state(big_state(2), state)
    for key in ("tied", "tied_too", "half"):
        assert state["model"][key] is target["model"][key]


def test_read_spans_fills_every_span_and_its_crc_is_the_file_s(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    blob = os.urandom(MIN_PARALLEL_BYTES + 12_345)
    path.write_bytes(blob)
    cuts = [0, 1, 4096, 5_000_000, 5_000_001, MIN_PARALLEL_BYTES - 3, len(blob)]
    buffers = [bytearray(hi - lo) for lo, hi in zip(cuts, cuts[1:], strict=False)]
    spans = [(lo, memoryview(b)) for lo, b in zip(cuts, buffers, strict=False)]
    for threads in (1, 3, 4):
        for b in buffers:
            b[:] = bytes(len(b))
        assert read_spans(str(path), spans, threads) == zlib.crc32(blob)
        assert b"".join(buffers) == blob
    assert checksum_file(str(path)) == (len(blob), zlib.crc32(blob))
    assert checksum_file(str(tmp_path / "blob"), threads=1) == (len(blob), zlib.crc32(blob))
    path.write_bytes(blob[:-1])
    with pytest.raises(EOFError, match="ends at"):
        read_spans(str(path), spans)


def test_a_url_storage_reads_spans_as_one_checksummed_stream() -> None:
    storage = FsspecStorage(f"memory://restore-{uuid.uuid4().hex[:8]}")
    blob = os.urandom(100_000)
    storage.write_atomic("part.bin", blob)
    buffers = [bytearray(10), bytearray(99_990)]
    spans = [(0, memoryview(buffers[0])), (10, memoryview(buffers[1]))]
    assert storage.read_into("part.bin", spans) == zlib.crc32(blob)
    assert b"".join(buffers) == blob
    assert storage.checksum("part.bin") == (len(blob), zlib.crc32(blob))
    storage.write_atomic("part.bin", blob[:-1])
    with pytest.raises(EOFError, match="ends at 99999 bytes"):
        storage.read_into("part.bin", spans)
