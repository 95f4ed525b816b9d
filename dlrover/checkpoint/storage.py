"""Where persisted checkpoints go: a small Storage interface over a local path or an fsspec URL."""

from __future__ import annotations

import abc
import contextlib
import ctypes
import errno
import mmap
import os
import queue
import shutil
import threading
import uuid
from collections.abc import Iterator, Sequence
from typing import IO, Any

from dlrover.checkpoint.config import PERSIST_CHUNK_BYTES, run_in_background
from dlrover.checkpoint.crc import crc32, crc32_combine
from dlrover.checkpoint.errors import CheckpointStorageError
from dlrover.checkpoint.read_ranges import ShortFileError, Span, checksum_file, read_spans

WRITE_THREADS = 4
"""Threads that write one large file to a local file system at once (each its own range)."""
WRITE_CHUNK_BYTES = 16 << 20
"""Bytes per write call of those threads (each checksums the chunk it just wrote)."""


class Storage(abc.ABC):
    """Byte files addressed by paths relative to a root.

    Invariant: ``write_atomic`` makes a file appear whole or not at all (temp + rename), which
    is what the commit protocol's markers rely on.
    """

    root: str

    @abc.abstractmethod
    def makedirs(self, rel: str) -> None:
        """Create directory ``rel`` (and parents); fine if it exists."""

    @abc.abstractmethod
    def open_write(self, rel: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """A binary stream that is durable (flushed, fsynced where possible) once closed."""

    @abc.abstractmethod
    def open_read(self, rel: str) -> contextlib.AbstractContextManager[IO[bytes]]:
        """A binary stream reading ``rel``."""

    @abc.abstractmethod
    def write_atomic(self, rel: str, data: bytes) -> None:
        """Write ``data`` to a temp file, then rename it over ``rel``."""

    @abc.abstractmethod
    def exists(self, rel: str) -> bool:
        """Whether ``rel`` exists (a file or a directory)."""
        ...

    @abc.abstractmethod
    def size(self, rel: str) -> int:
        """Size of file ``rel`` in bytes; raises an OSError (usually FileNotFoundError) if it is
        missing."""
        ...

    @abc.abstractmethod
    def listdir(self, rel: str) -> list[str]:
        """Names (not paths) in directory ``rel``; empty if it does not exist."""

    @abc.abstractmethod
    def remove_tree(self, rel: str) -> None:
        """Delete directory ``rel`` and everything under it; fine if it does not exist."""
        ...

    @abc.abstractmethod
    def remove(self, rel: str) -> None:
        """Delete one file; fine if it does not exist."""

    def url(self, rel: str) -> str:
        """The full path/URL of ``rel`` (for DCP readers/writers and messages)."""
        return f"{self.root.rstrip('/')}/{rel}" if rel else self.root

    def read_bytes(self, rel: str) -> bytes:
        """The whole content of file ``rel``; a missing file raises FileNotFoundError."""
        with self.open_read(rel) as f:
            return f.read()

    def read_into(self, rel: str, spans: Sequence[Span]) -> int:
        """Fill ``spans`` (contiguous, in file order, from offset 0) with the bytes of file
        ``rel``, read once; returns their CRC-32, computed as they arrive. A missing file raises
        FileNotFoundError, one shorter than the spans ShortFileError."""
        crc = 0
        with self.open_read(rel) as f:
            for offset, view in spans:
                done = 0
                while done < len(view):
                    n = f.readinto(view[done:])  # type: ignore[attr-defined]
                    if not n:
                        raise ShortFileError(
                            f"{self.url(rel)} ends at {offset + done} bytes; "
                            f"{offset + len(view)} were expected"
                        )
                    done += n
                crc = crc32(view, crc)
        return crc

    def checksum(self, rel: str) -> tuple[int, int]:
        """(size, CRC-32) of file ``rel``, read in chunks; FileNotFoundError if it is missing."""
        crc, size = 0, 0
        with self.open_read(rel) as f:
            while chunk := f.read(PERSIST_CHUNK_BYTES):
                crc = crc32(chunk, crc)
                size += len(chunk)
        return size, crc

    @contextlib.contextmanager
    def stream(self, rel: str) -> Iterator[StreamSink]:
        """Write ``rel`` from the start through a sink that checksums as it goes, for writers
        that produce a file piece by piece (``torch.save``); stored as durably as
        ``open_write`` stores when the block ends without error."""
        with self.open_write(rel) as f:
            yield StreamSink(f)

    def write_from(self, rel: str, data: memoryview) -> int:
        """Write ``data`` (e.g. a shared-memory mapping) as file ``rel``, durable on return as
        ``open_write`` makes it; returns its CRC-32, computed while writing."""
        crc = 0
        with self.open_write(rel) as f:
            for start in range(0, len(data), PERSIST_CHUNK_BYTES):
                chunk = data[start : start + PERSIST_CHUNK_BYTES]
                f.write(chunk)
                crc = crc32(chunk, crc)
        return crc


class StreamSink:
    """What ``Storage.stream`` yields: a file-like ``write`` (``torch.save`` writes into it)
    that keeps the CRC-32 and the size of everything written."""

    def __init__(self, out: IO[bytes]) -> None:
        self._out = out
        self.crc = 0
        self.size = 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Write ``data`` whole; its length."""
        view = memoryview(data).cast("B")
        self.crc = crc32(view, self.crc)
        self.size += view.nbytes
        self._out.write(view)
        return view.nbytes

    def flush(self) -> None:
        """Nothing held back here (the stream is flushed when the block ends)."""


class LocalStorage(Storage):
    """A directory on a local or mounted file system; writes are fsynced."""

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def _p(self, rel: str) -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def makedirs(self, rel: str) -> None:
        """Create the directory and its parents; CheckpointStorageError if the file system
        refuses."""
        try:
            os.makedirs(self._p(rel), exist_ok=True)
        except OSError as exc:
            raise CheckpointStorageError(
                f"cannot create checkpoint directory {self._p(rel)!r}: {exc.strerror}; "
                "choose a writable checkpoint_dir"
            ) from exc

    @contextlib.contextmanager
    def open_write(self, rel: str) -> Iterator[IO[bytes]]:
        """Write ``rel`` from the start; flushed and fsynced when the block ends without error,
        closed either way. CheckpointStorageError if it cannot be opened."""
        path = self._p(rel)
        try:
            f = open(path, "wb")  # noqa: SIM115 - closed below after fsync
        except OSError as exc:
            raise CheckpointStorageError(f"cannot write {path!r}: {exc.strerror}") from exc
        try:
            yield f
            f.flush()
            os.fsync(f.fileno())
        finally:
            f.close()

    @contextlib.contextmanager
    def open_read(self, rel: str) -> Iterator[IO[bytes]]:
        """Read ``rel``; a missing file raises FileNotFoundError (not wrapped)."""
        with open(self._p(rel), "rb") as f:
            yield f

    def read_into(self, rel: str, spans: Sequence[Span]) -> int:
        """As ``Storage.read_into``, a large file read by several threads at once (each its own
        range and descriptor), each chunk checksummed as it lands (the CRC releases the GIL)."""
        return read_spans(self._p(rel), spans)

    def checksum(self, rel: str) -> tuple[int, int]:
        """As ``Storage.checksum``, a large file read by several threads at once."""
        return checksum_file(self._p(rel))

    @contextlib.contextmanager
    def stream(self, rel: str) -> Iterator[StreamSink]:
        """As ``Storage.stream``, the bytes gathered into page-aligned chunks that a second
        thread writes with O_DIRECT while the next chunk fills (the file does not pass through,
        nor fill, the page cache); buffered where the file system refuses O_DIRECT. fsynced
        when the block ends without error; CheckpointStorageError on a failed write."""
        path = self._p(rel)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as exc:
            raise CheckpointStorageError(f"cannot write {path!r}: {exc.strerror}") from exc
        direct_fd = _open_direct(path)
        sink = _DirectSink(fd, direct_fd)
        try:
            yield sink
            sink.finish()
            os.fsync(fd)
        except OSError as exc:
            raise CheckpointStorageError(f"cannot write {path!r}: {exc.strerror}") from exc
        finally:
            sink.close()
            if direct_fd >= 0:
                os.close(direct_fd)
            os.close(fd)

    def write_from(self, rel: str, data: memoryview) -> int:
        """Write ``data`` as file ``rel`` from WRITE_THREADS threads at once, each writing and
        checksumming its own range straight from ``data`` (no copy), then fsync once; returns the
        file's CRC-32. The threads run at the persist's low priority.

        A page-aligned buffer (a shared-memory segment) is written with O_DIRECT where the file
        system takes it: the bytes go from the mapping to the device without passing through
        (and filling) the page cache. Elsewhere, and for the unaligned tail, writes are buffered.
        """
        path = self._p(rel)
        total = len(data)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as exc:
            raise CheckpointStorageError(f"cannot write {path!r}: {exc.strerror}") from exc
        try:
            _reserve_file(fd, total)
            direct_fd = _open_direct(path) if _page_aligned(data) else -1
            direct_len = total // _DIRECT_ALIGN * _DIRECT_ALIGN if direct_fd >= 0 else 0
            try:
                ranges = _split(direct_len, _DIRECT_ALIGN) + _split(
                    total - direct_len, 1, direct_len
                )
                crcs = _write_ranges(data, ranges, fd, direct_fd, direct_len)
            finally:
                if direct_fd >= 0:
                    os.close(direct_fd)
            os.fsync(fd)
        except OSError as exc:
            raise CheckpointStorageError(f"cannot write {path!r}: {exc.strerror}") from exc
        finally:
            os.close(fd)
        crc = 0
        for (lo, hi), part in zip(ranges, crcs, strict=True):
            crc = crc32_combine(crc, part, hi - lo)
        return crc

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Write a fsynced temp file beside ``rel``, rename it over ``rel`` and fsync the directory;
        on failure the temp file is removed and CheckpointStorageError raised."""
        path = self._p(rel)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            dir_fd = os.open(os.path.dirname(path), os.O_RDONLY)
            try:
                os.fsync(dir_fd)  # makes the rename itself durable
            finally:
                os.close(dir_fd)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise CheckpointStorageError(f"cannot write {path!r}: {exc.strerror}") from exc

    def exists(self, rel: str) -> bool:
        """Whether the path exists (a file or a directory)."""
        return os.path.exists(self._p(rel))

    def size(self, rel: str) -> int:
        """File size in bytes; OSError if it is missing."""
        return os.path.getsize(self._p(rel))

    def listdir(self, rel: str) -> list[str]:
        """Sorted names in the directory; empty if it does not exist."""
        try:
            return sorted(os.listdir(self._p(rel)))
        except FileNotFoundError:
            return []

    def remove_tree(self, rel: str) -> None:
        """Delete the directory tree; every error is ignored (a missing tree, but also one that
        cannot be removed)."""
        shutil.rmtree(self._p(rel), ignore_errors=True)

    def remove(self, rel: str) -> None:
        """Delete one file; fine if it does not exist."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._p(rel))


class FsspecStorage(Storage):
    """Any fsspec URL (s3://, gs://, hdfs://, memory://...). ``write_atomic`` puts a temp object
    and moves it over the target, so it is as atomic as the backend's move (on object stores a
    copy then a delete: the target object appears whole)."""

    def __init__(self, url: str, **options: Any) -> None:
        import fsspec

        self.fs, path = fsspec.core.url_to_fs(url, **options)
        self.root = url.rstrip("/")
        self._path = path.rstrip("/")

    def _p(self, rel: str) -> str:
        return f"{self._path}/{rel}" if rel else self._path

    def makedirs(self, rel: str) -> None:
        """Create directory ``rel`` through the backend; CheckpointStorageError if it refuses."""
        try:
            self.fs.makedirs(self._p(rel), exist_ok=True)
        except OSError as exc:
            raise CheckpointStorageError(f"cannot create {self.url(rel)!r}: {exc}") from exc

    @contextlib.contextmanager
    def open_write(self, rel: str) -> Iterator[IO[bytes]]:
        """A binary stream to ``rel``; the backend stores it when the stream closes, as durably as
        the backend does."""
        with self.fs.open(self._p(rel), "wb") as f:
            yield f

    @contextlib.contextmanager
    def open_read(self, rel: str) -> Iterator[IO[bytes]]:
        """A binary stream reading ``rel``; the backend's error if it is missing."""
        with self.fs.open(self._p(rel), "rb") as f:
            yield f

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Put ``data`` to a temp object beside ``rel``, then move it over ``rel``;
        CheckpointStorageError on failure (the temp object may be left behind)."""
        tmp = f"{self._p(rel)}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, self._p(rel))
        except OSError as exc:
            raise CheckpointStorageError(f"cannot write {self.url(rel)!r}: {exc}") from exc

    def exists(self, rel: str) -> bool:
        """Whether ``rel`` exists on the backend."""
        return bool(self.fs.exists(self._p(rel)))

    def size(self, rel: str) -> int:
        """Size of ``rel`` in bytes, as the backend reports it."""
        return int(self.fs.size(self._p(rel)))

    def listdir(self, rel: str) -> list[str]:
        """Sorted names under ``rel`` (not paths); empty if it does not exist."""
        try:
            names = self.fs.ls(self._p(rel), detail=False)
        except FileNotFoundError:
            return []
        return sorted(str(n).rstrip("/").rsplit("/", 1)[-1] for n in names)

    def remove_tree(self, rel: str) -> None:
        """Delete ``rel`` recursively; fine if it does not exist."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._p(rel), recursive=True)

    def remove(self, rel: str) -> None:
        """Delete one file; fine if it does not exist."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._p(rel))


_DIRECT_ALIGN = 4096
"""O_DIRECT wants buffer address, file offset and length in multiples of the block size."""


def _page_aligned(data: memoryview) -> bool:
    """Whether ``data`` is writable memory starting on a page (a mapping, or a slice of one at
    a page offset): only such a buffer can be written with O_DIRECT."""
    if data.readonly or not data.contiguous or not len(data):
        return False
    view = ctypes.c_char.from_buffer(data)
    try:
        return ctypes.addressof(view) % _DIRECT_ALIGN == 0
    finally:
        del view  # releases the export, so the mapping can be closed later


def _open_direct(path: str) -> int:
    """A second descriptor of ``path`` with O_DIRECT, or -1 where that is not available (tmpfs
    and some network file systems refuse it)."""
    if not hasattr(os, "O_DIRECT"):
        return -1
    try:
        return os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError:
        return -1


def _reserve_file(fd: int, size: int) -> None:
    """Give the file its final size, allocated up front where the file system can."""
    if not size:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError:
        os.ftruncate(fd, size)  # no fallocate here: a sparse file, filled by the writes


def _split(length: int, align: int, base: int = 0) -> list[tuple[int, int]]:
    """[base, base + length) in up to WRITE_THREADS ranges whose starts are ``align``-aligned."""
    if length <= 0:
        return []
    per = -(-length // WRITE_THREADS)
    per = -(-per // align) * align
    return [(base + lo, base + min(lo + per, length)) for lo in range(0, length, per)]


def _write_ranges(
    data: memoryview, ranges: list[tuple[int, int]], fd: int, direct_fd: int, direct_end: int
) -> list[int]:
    """Write each range from its own thread (O_DIRECT below ``direct_end``); the ranges' CRCs.
    A write O_DIRECT refuses after all (EINVAL) is repeated buffered."""
    crcs = [0] * len(ranges)
    errors: list[OSError] = []

    def write_range(i: int) -> None:
        run_in_background()
        lo, hi = ranges[i]
        target = direct_fd if hi <= direct_end and direct_fd >= 0 else fd
        crc = 0
        try:
            for start in range(lo, hi, WRITE_CHUNK_BYTES):
                chunk = data[start : min(start + WRITE_CHUNK_BYTES, hi)]
                done = 0
                while done < len(chunk):  # a write may take less than asked
                    try:
                        done += os.pwrite(target, chunk[done:], start + done)
                    except OSError as exc:
                        if target == fd or exc.errno != errno.EINVAL:
                            raise
                        target = fd
                crc = crc32(chunk, crc)
        except OSError as exc:
            errors.append(exc)
        crcs[i] = crc

    threads = [
        threading.Thread(target=write_range, args=(i,), name=f"ckpt-write-{i}")
        for i in range(len(ranges))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return crcs


def storage_for(location: str) -> Storage:
    """LocalStorage for a plain path or file:// URL, FsspecStorage for any other URL."""
    if location.startswith("file://"):
        return LocalStorage(location[len("file://") :])
    if "://" in location:
        return FsspecStorage(location)
    return LocalStorage(location)


STREAM_CHUNK_BYTES = 16 << 20
"""Bytes of each of the two page-aligned chunks a streamed local write alternates between."""


class _DirectSink(StreamSink):
    """A StreamSink over a local file: ``write`` copies into one of two page-aligned chunks; a
    full chunk goes to a writer thread (O_DIRECT where ``direct_fd`` >= 0) while the other
    fills. ``finish`` writes the partial last chunk buffered and waits for the thread."""

    def __init__(self, fd: int, direct_fd: int) -> None:
        self._fd, self._direct_fd = fd, direct_fd
        self.crc = 0
        self.size = 0
        self._chunks = [mmap.mmap(-1, STREAM_CHUNK_BYTES) for _ in range(2)]
        self._filling = 0
        self._used = 0
        self._offset = 0  # of the chunk being filled, in the file
        self._free = [threading.Event(), threading.Event()]
        for free in self._free:
            free.set()
        self._jobs: queue.SimpleQueue[tuple[int, int, int] | None] = queue.SimpleQueue()
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._write_loop, name="ckpt-stream", daemon=True)
        self._thread.start()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        self.crc = crc32(view, self.crc)
        self.size += view.nbytes
        done = 0
        while done < view.nbytes:
            if self._error is not None:
                raise self._error
            chunk = self._chunks[self._filling]
            n = min(view.nbytes - done, STREAM_CHUNK_BYTES - self._used)
            chunk[self._used : self._used + n] = view[done : done + n]
            self._used += n
            done += n
            if self._used == STREAM_CHUNK_BYTES:
                self._hand_over()
        return view.nbytes

    def _hand_over(self) -> None:
        """Give the filled chunk to the writer; fill the other once it is written."""
        index = self._filling
        self._free[index].clear()
        self._jobs.put((index, self._used, self._offset))
        self._offset += self._used
        self._filling, self._used = 1 - index, 0
        self._free[self._filling].wait()

    def _write_loop(self) -> None:
        run_in_background()
        while (job := self._jobs.get()) is not None:
            index, length, offset = job
            try:
                if self._error is None:
                    self._pwrite(self._chunks[index], length, offset)
            except OSError as exc:
                self._error = exc
            finally:
                self._free[index].set()

    def _pwrite(self, chunk: mmap.mmap, length: int, offset: int) -> None:
        view = memoryview(chunk)[:length]
        try:
            aligned = length // _DIRECT_ALIGN * _DIRECT_ALIGN if self._direct_fd >= 0 else 0
            if aligned:
                try:
                    _pwrite_all(self._direct_fd, view[:aligned], offset)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    self._direct_fd = -1  # refused after all: buffered from here on
                    aligned = 0
            if aligned < length:
                _pwrite_all(self._fd, view[aligned:], offset + aligned)
        finally:
            view.release()

    def finish(self) -> None:
        """Write what is left and wait for every write; raises the first write's error."""
        if self._used:
            self._hand_over()
        self._jobs.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        """Stop the writer (if ``finish`` did not) and free the chunks."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        for chunk in self._chunks:
            chunk.close()


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
