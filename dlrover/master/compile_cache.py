"""The job's compile caches, kept by the master for nodes that share no filesystem.

With ``--compile-cache master`` each node keeps torch's inductor and Triton caches in a folder
of its own machine and sends the files its workers compiled to the master
(`dlrover.agent.compile_cache.CacheSync`); a node starting on a fresh machine fetches them before
its workers start, so it compiles from the job's cache instead of from scratch. The files are
content-addressed by their digest, written once and never changed (torch writes a cache entry
once), held in the master's memory up to a bound.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from dlrover.api.master import CACHE_CHUNK_BYTES, CacheFile, cache_digest, checked_cache_name

MAX_CACHE_FILE_BYTES = 512 * 1024 * 1024
MAX_UPLOADS = 64
"""Files being sent at once; a node that stopped halfway loses its place to a newer one."""
DEFAULT_MAX_CACHE_BYTES = 2 * 1024 * 1024 * 1024
"""What the master holds at most (files beyond it are refused; nodes compile those locally)."""


class CacheError(ValueError):
    """A cache request the master refuses (travels as a MasterRequestError)."""


@dataclass
class _Upload:
    size: int
    digest: str
    parts: list[bytes] = field(default_factory=list)
    received: int = 0


class CompileCacheStore:
    """Cache files by name, in memory, at most ``max_bytes`` in all. Serves
    `dlrover.api.master.CompileCacheApi`."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_CACHE_BYTES) -> None:
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._files: dict[str, tuple[CacheFile, bytes]] = {}
        self._uploads: dict[str, _Upload] = {}
        self._bytes = 0

    def cache_files(self) -> tuple[CacheFile, ...]:
        """Every complete file held."""
        with self._lock:
            return tuple(entry for entry, _ in self._files.values())

    def cache_read(self, name: str, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes (at most CACHE_CHUNK_BYTES) of ``name`` from ``offset``."""
        with self._lock:
            held = self._files.get(name)
        if held is None:
            raise CacheError(f"compile cache file {name!r}: the master does not hold it")
        if offset < 0 or length < 0:
            raise CacheError(f"compile cache read of {name!r}: a negative offset or length")
        return held[1][offset : offset + min(length, CACHE_CHUNK_BYTES)]

    def cache_write(self, name: str, size: int, digest: str, offset: int, data: bytes) -> bool:
        """Take the next part of ``name``; True once it is whole and its digest matched."""
        name = checked_cache_name(name)  # its ValueError is a refusal, as CacheError is
        if not 0 <= size <= MAX_CACHE_FILE_BYTES:
            raise CacheError(
                f"compile cache file {name!r}: {size} bytes; the limit is {MAX_CACHE_FILE_BYTES}"
            )
        if len(data) > CACHE_CHUNK_BYTES:
            raise CacheError(f"a part of {len(data)} bytes; the limit is {CACHE_CHUNK_BYTES}")
        with self._lock:
            held = self._files.get(name)
            if held is not None:
                return held[0].digest == digest  # written once: the same content is done
            upload = self._uploads.get(name)
            if offset == 0:
                if self._bytes + size > self._max_bytes:
                    raise CacheError(
                        f"the job's compile cache on the master is full ({self._bytes} of "
                        f"{self._max_bytes} bytes): {name!r} is compiled on each node"
                    )
                if len(self._uploads) >= MAX_UPLOADS:  # abandoned ones: the oldest goes
                    del self._uploads[next(iter(self._uploads))]
                upload = self._uploads[name] = _Upload(size, digest)
            elif upload is None or upload.received != offset or upload.digest != digest:
                raise CacheError(f"compile cache file {name!r}: a part out of order ({offset})")
            upload.parts.append(data)
            upload.received += len(data)
            if upload.received < size:
                return False
            del self._uploads[name]
            content = b"".join(upload.parts)
            if upload.received != size or cache_digest(content) != digest:
                raise CacheError(f"compile cache file {name!r}: its content does not match")
            self._files[name] = (CacheFile(name, size, digest), content)
            self._bytes += size
            return True
