"""Reading a local file into caller-given buffers from several threads, checksummed as it is read."""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from dlrover.checkpoint.crc import crc32, crc32_combine

READ_THREADS = 4
"""Threads that read one large file at once, each a contiguous range through its own descriptor
(so the kernel's readahead sees one sequential reader per range)."""
READ_CHUNK_BYTES = 4 << 20
"""Bytes per read call; each chunk is checksummed right after it lands, while it is in cache."""
MIN_PARALLEL_BYTES = 32 << 20
"""Files smaller than this are read by one thread: threads would cost more than they save."""

Span = tuple[int, memoryview]
"""(offset in the file, the writable bytes that receive ``len(view)`` bytes from there)."""


class ShortFileError(EOFError):
    """The file ended before every span was filled."""


def split_spans(spans: Sequence[Span], parts: int) -> list[list[Span]]:
    """``spans`` (in file order, contiguous) cut into up to ``parts`` groups of about equal
    bytes; a span crossing a group boundary is sliced, so every group is contiguous too."""
    total = sum(len(view) for _, view in spans)
    if total == 0:
        return []
    per = -(-total // max(1, parts))
    groups: list[list[Span]] = [[]]
    room = per
    for offset, view in spans:
        while len(view):
            if room == 0:
                groups.append([])
                room = per
            take = min(room, len(view))
            groups[-1].append((offset, view[:take]))
            offset, view, room = offset + take, view[take:], room - take
    return groups


def _read_group(path: str, group: list[Span]) -> tuple[int, int]:
    """Fill one contiguous group from its own descriptor; (crc32, bytes) of the group."""
    crc, length = 0, 0
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, view in group:
            for start in range(0, len(view), READ_CHUNK_BYTES):
                chunk = view[start : start + READ_CHUNK_BYTES]
                done = 0
                while done < len(chunk):  # a read may return less than asked
                    n = os.preadv(fd, [chunk[done:]], offset + start + done)
                    if n == 0:
                        raise ShortFileError(
                            f"{path} ends at {offset + start + done} bytes; "
                            f"{offset + start + len(chunk)} were expected"
                        )
                    done += n
                crc = crc32(chunk, crc)  # releases the GIL on large buffers
            length += len(view)
    finally:
        os.close(fd)
    return crc, length


def read_spans(path: str, spans: Sequence[Span], threads: int = READ_THREADS) -> int:
    """Fill ``spans`` (contiguous, in file order, from offset 0) with the bytes of ``path``;
    returns the CRC-32 of those bytes. Large files are read by ``threads`` threads at once,
    each a range, and the ranges' CRCs are combined. Raises ShortFileError if the file is
    shorter than the spans, OSError as the reads raise it."""
    total = sum(len(view) for _, view in spans)
    parts = threads if total >= MIN_PARALLEL_BYTES else 1
    groups = split_spans(spans, parts)
    if len(groups) <= 1:
        return _read_group(path, groups[0])[0] if groups else 0
    with ThreadPoolExecutor(len(groups), thread_name_prefix="ckpt-read") as pool:
        results = list(pool.map(lambda g: _read_group(path, g), groups))
    crc = 0
    for part, length in results:
        crc = crc32_combine(crc, part, length)
    return crc


def checksum_file(path: str, threads: int = READ_THREADS) -> tuple[int, int]:
    """(size, CRC-32) of ``path``, large files read by ``threads`` threads at once into buffers
    of their own (reused, so nothing is allocated per chunk)."""
    size = os.path.getsize(path)
    parts = max(1, min(threads, -(-size // MIN_PARALLEL_BYTES))) if size else 1
    per = -(-size // parts) if size else 0

    def one(lo: int) -> tuple[int, int]:
        hi = min(size, lo + per)
        buf = memoryview(bytearray(min(READ_CHUNK_BYTES, hi - lo)))
        crc = 0
        fd = os.open(path, os.O_RDONLY)
        try:
            at = lo
            while at < hi:
                n = os.preadv(fd, [buf[: min(len(buf), hi - at)]], at)
                if n == 0:  # the file shrank since it was measured
                    break
                crc = crc32(buf[:n], crc)
                at += n
        finally:
            os.close(fd)
        return crc, at - lo

    starts = list(range(0, size, per)) if size else [0]
    if len(starts) == 1:
        results = [one(0)]
    else:
        with ThreadPoolExecutor(len(starts), thread_name_prefix="ckpt-verify") as pool:
            results = list(pool.map(one, starts))
    crc, length = 0, 0
    for part, n in results:
        crc = crc32_combine(crc, part, n)
        length += n
    return length, crc
