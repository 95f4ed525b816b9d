"""The segment header (a seqlock) and its JSON metadata: read and written without torch."""

from __future__ import annotations

import json
import struct
from typing import Any, Protocol

from dlrover.checkpoint.errors import SegmentStateError

MAGIC = b"DLRCKPT1"
_HEADER = struct.Struct("<8sQqQQQ")  # magic, seq, step, data_len, meta_offset, meta_len
_SEQ = struct.Struct("<Q")
_SEQ_OFFSET = 8
HEADER_SIZE = 4096  # data starts page aligned, which keeps the copies on the fast path
ALIGN = 64
FORMAT_VERSION = 1

# Segment header protocol (a seqlock): the writer makes ``seq`` odd before touching any byte
# and even again after the metadata is in place. A reader takes a snapshot only if ``seq`` is
# even and unchanged across its read, so a copy torn by a crash (seq left odd) never loads.
# This module is all the agent needs to judge a segment; it must never import torch (the
# agent stays small and starts fast), which a test checks.


class Mapped(Protocol):
    """What the header code needs of a segment (``SharedSegment`` provides it)."""

    path: str
    size: int

    @property
    def buffer(self) -> memoryview:
        """The segment's bytes, writable, ``size`` long."""
        ...


def align(n: int) -> int:
    """``n`` rounded up to a multiple of ALIGN (64 bytes)."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def read_header(seg: Mapped) -> tuple[int, int, int, int, int]:
    """(seq, step, data_len, meta_offset, meta_len) of ``seg``; raises if it holds nothing."""
    if seg.size < HEADER_SIZE:
        raise SegmentStateError(f"segment {seg.path} is empty")
    magic, seq, step, data_len, meta_offset, meta_len = _HEADER.unpack_from(seg.buffer, 0)
    if magic != MAGIC:
        raise SegmentStateError(f"segment {seg.path} holds no checkpoint yet")
    return seq, step, data_len, meta_offset, meta_len


def read_seq(seg: Mapped) -> int:
    """The header's sequence number (odd: a copy is in progress or was torn)."""
    if seg.size < HEADER_SIZE:
        return 0
    return int(_SEQ.unpack_from(seg.buffer, _SEQ_OFFSET)[0])


def begin_write(seg: Mapped) -> int:
    """Mark ``seg`` as being written (odd seq) and return that seq for ``publish``."""
    buf = seg.buffer
    seq = read_seq(seg) if bytes(buf[: len(MAGIC)]) == MAGIC else 0
    writing = seq + 1 if seq % 2 == 0 else seq + 2
    _HEADER.pack_into(buf, 0, MAGIC, writing, -1, 0, 0, 0)
    return writing


def publish(seg: Mapped, writing: int, step: int, data_len: int, meta: bytes) -> None:
    """Write the metadata after the data, then make the step visible (even seq) last."""
    meta_offset = HEADER_SIZE + align(data_len)
    buf = seg.buffer
    buf[meta_offset : meta_offset + len(meta)] = meta
    _HEADER.pack_into(buf, 0, MAGIC, writing, step, data_len, meta_offset, len(meta))
    _SEQ.pack_into(buf, _SEQ_OFFSET, writing + 1)


def image_len(seg: Mapped) -> int:
    """Bytes from the start of ``seg`` to the end of its metadata: what a copy of its complete
    step needs. Raises SegmentStateError if it holds nothing."""
    _, _, _, meta_offset, meta_len = read_header(seg)
    return meta_offset + meta_len


def install_header(seg: Mapped, writing: int, header: bytes) -> None:
    """Make a step copied in from elsewhere visible: ``header`` is the source's first
    HEADER_SIZE bytes, ``writing`` the odd seq ``begin_write`` returned before the copy. The
    header goes in under that odd seq, the even seq last (as ``publish`` does)."""
    magic, _, step, data_len, meta_offset, meta_len = _HEADER.unpack_from(header, 0)
    if magic != MAGIC:
        raise SegmentStateError(f"segment {seg.path}: the copied image has no checkpoint header")
    buf = seg.buffer
    buf[_HEADER.size : HEADER_SIZE] = header[_HEADER.size : HEADER_SIZE]
    _HEADER.pack_into(buf, 0, MAGIC, writing, step, data_len, meta_offset, meta_len)
    _SEQ.pack_into(buf, _SEQ_OFFSET, writing + 1)


def read_metadata(seg: Mapped) -> tuple[int, dict[str, Any]]:
    """Return (seq, metadata) of the complete step in ``seg`` or raise SegmentStateError."""
    seq, step, _, meta_offset, meta_len = read_header(seg)
    if seq % 2 == 1:
        raise SegmentStateError(f"segment {seg.path}: a copy is in progress or was torn")
    meta = json.loads(bytes(seg.buffer[meta_offset : meta_offset + meta_len]))
    if read_seq(seg) != seq:
        raise SegmentStateError(f"segment {seg.path} changed while its metadata was read")
    if meta.get("version") != FORMAT_VERSION or meta.get("step") != step:
        raise SegmentStateError(f"segment {seg.path}: metadata does not match its header")
    return seq, meta


def complete_step(seg: Mapped) -> int | None:
    """The step held completely in ``seg``, or None."""
    try:
        return int(read_metadata(seg)[1]["step"])
    except SegmentStateError:
        return None
