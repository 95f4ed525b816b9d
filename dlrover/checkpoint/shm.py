"""A named POSIX shared-memory segment (a file in /dev/shm, mmapped) that outlives its writers."""

from __future__ import annotations

import errno
import mmap
import os
import re
from typing import TYPE_CHECKING

from dlrover.checkpoint.config import DEFAULT_SHM_DIR
from dlrover.checkpoint.errors import CheckpointError, ShmSpaceError

if TYPE_CHECKING:
    import torch

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


def shm_free_bytes(shm_dir: str = DEFAULT_SHM_DIR) -> int:
    """Bytes an unprivileged process may still allocate in the tmpfs at ``shm_dir``."""
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


class SharedSegment:
    """One mmapped shared file. The creator (the saver) sizes it; others attach to it.

    Invariants: ``size`` is the length of the current mapping; ``buffer`` is its raw bytes and
    ``tensor`` a uint8 view of it (``torch.frombuffer``), so copies into it are plain memcpys;
    pages are allocated and faulted in when the segment is created or grown, never during a
    save. torch is imported only when ``tensor`` is first used (by a trainer): the agent maps
    and streams segments through ``buffer`` alone and never loads torch.
    """

    def __init__(self, path: str, fd: int, size: int) -> None:
        self.path = path
        self._fd = fd
        self.size = 0
        self._map: mmap.mmap | None = None
        self._tensor: torch.Tensor | None = None
        self._map_file(size)

    # ------------------------------------------------------------------ construction
    @classmethod
    def create(cls, name: str, size: int, shm_dir: str = DEFAULT_SHM_DIR) -> SharedSegment:
        """Create (or adopt an existing) segment ``name`` of at least ``size`` bytes."""
        if not _NAME_RE.match(name):
            raise CheckpointError(f"invalid segment name {name!r}: use letters, digits, _ . -")
        path = os.path.join(shm_dir, name)
        created = not os.path.exists(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            current = os.fstat(fd).st_size
            if size > current:
                _reserve(fd, path, current, size, shm_dir)
            return cls(path, fd, max(size, current))
        except BaseException:
            os.close(fd)
            if created:  # leave nothing behind when the allocation is refused
                os.unlink(path)
            raise

    @classmethod
    def attach(cls, path: str) -> SharedSegment:
        """Map an existing segment created by a saver (e.g. after a worker restart)."""
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError as exc:
            raise CheckpointError(f"shared segment {path!r} does not exist") from exc
        try:
            return cls(path, fd, os.fstat(fd).st_size)
        except BaseException:
            os.close(fd)
            raise

    # ------------------------------------------------------------------ sizing
    def grow(self, size: int) -> None:
        """Enlarge the file to ``size`` bytes (no-op if already that big) and remap."""
        current = os.fstat(self._fd).st_size
        if size > current:
            _reserve(self._fd, self.path, current, size, os.path.dirname(self.path))
        self.remap()

    def remap(self) -> None:
        """Map the file again at its current length (another process may have grown it)."""
        size = os.fstat(self._fd).st_size
        if size != self.size:
            self._unmap()
            self._map_file(size)

    def _map_file(self, size: int) -> None:
        if size == 0:
            return
        # MAP_POPULATE faults every page in now, so the first save pays no page faults.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._map = mmap.mmap(self._fd, size, flags=flags)
        self.size = size

    def _unmap(self) -> None:
        self._tensor = None
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                # A caller still holds a view; the mapping is freed when that view dies.
                pass
            self._map = None
        self.size = 0

    @property
    def tensor(self) -> torch.Tensor:
        """A uint8 tensor aliasing the whole mapping (built on first use, torch loaded then)."""
        if self._tensor is None:
            import torch

            if self._map is None:
                return torch.empty(0, dtype=torch.uint8)
            self._tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        return self._tensor

    @property
    def buffer(self) -> memoryview:
        """The raw bytes of the mapping (for struct access and streaming to storage)."""
        if self._map is None:
            return memoryview(b"")
        return memoryview(self._map)

    def close(self, unlink: bool = False) -> None:
        """Unmap; with ``unlink`` also remove the file so its memory goes back to the host."""
        self._unmap()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def _reserve(fd: int, path: str, current: int, size: int, shm_dir: str) -> None:
    """Allocate bytes [current, size) of the tmpfs file, or raise ShmSpaceError."""
    needed = size - current
    free = shm_free_bytes(shm_dir)
    if needed > free:
        raise ShmSpaceError(path, needed, free)
    try:
        # fallocate on tmpfs allocates the pages for real, so a later write cannot SIGBUS.
        os.posix_fallocate(fd, current, needed)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise ShmSpaceError(path, needed, shm_free_bytes(shm_dir)) from exc
        raise CheckpointError(f"cannot allocate {needed} bytes in {path!r}: {exc}") from exc
