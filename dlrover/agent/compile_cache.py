"""A node's side of ``--compile-cache master``: the job's compile caches without a shared
filesystem.

The workers' inductor and Triton caches live in a folder of this machine
(`local_cache_folder`). Before the first workers start, the agent fetches every file the job's
nodes shared so far from the master (`CacheSync.pull`), so a node on a fresh machine compiles
from the job's cache instead of from scratch; while the job runs, a thread sends the files this
node's workers wrote to the master (`CacheSync.push_new`), and a last push runs as the agent
closes. torch writes each cache entry once, under a temporary name that it then renames
(`write_atomic`), so a file whose size and time stayed the same between two scans is complete.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time

from dlrover.api.errors import MasterRequestError
from dlrover.api.master import (
    CACHE_CHUNK_BYTES,
    CompileCacheApi,
    cache_digest,
    checked_cache_name,
)

logger = logging.getLogger(__name__)

DEFAULT_PUSH_INTERVAL_S = 2.0
DEFAULT_PULL_DEADLINE_S = 120.0
DEFAULT_CLOSE_DEADLINE_S = 10.0


def local_cache_folder(job: str) -> str:
    """This machine's folder of the job's compile caches (under its temp folder, as torch's
    own caches are)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in job) or "job"
    return os.path.join(tempfile.gettempdir(), f"dlrover-compile-cache-{safe}")


def _skipped(name: str) -> bool:
    """Files that are no cache entries: temporary names being written, and lock files."""
    base = name.rsplit("/", 1)[-1]
    return base.startswith(".") or base.endswith((".lock", ".tmp")) or "/tmp" in f"/{name}"


class CacheSync:
    """Fetches the job's cache files into ``folder`` and sends the new ones back."""

    def __init__(
        self, api: CompileCacheApi, folder: str, interval_s: float = DEFAULT_PUSH_INTERVAL_S
    ) -> None:
        self._api = api
        self.folder = folder
        self._interval_s = interval_s
        self._done: set[str] = set()  # on the master (fetched from it, or sent to it)
        self._seen: dict[str, tuple[int, int]] = {}  # name -> (size, mtime) at the last scan
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one push at a time (the thread's and close's)
        self.pushed_files = 0
        self.pushed_bytes = 0

    def pull(self, deadline_s: float = DEFAULT_PULL_DEADLINE_S) -> tuple[int, int]:
        """Fetch every file the master holds that this folder lacks: (files, bytes) fetched.
        Stops at the deadline (the rest is compiled here); never raises for the master."""
        os.makedirs(self.folder, exist_ok=True)
        began = time.monotonic()
        end = began + deadline_s
        try:
            files = self._api.cache_files()
        except Exception as e:  # the cache is an optimisation: compile locally instead
            logger.warning("compile cache: cannot list the job's files on the master: %s", e)
            return 0, 0
        fetched = size = 0
        for entry in files:
            if time.monotonic() > end:
                logger.warning(
                    "compile cache: %d of %d files not fetched within %.0fs; the workers "
                    "compile them here", len(files) - fetched, len(files), deadline_s
                )  # fmt: skip
                break
            try:
                path = self._path(entry.name)
            except ValueError:
                continue
            if os.path.exists(path):
                self._done.add(entry.name)
                continue
            try:
                data = self._read(entry.name, entry.size)
            except Exception as e:
                logger.warning("compile cache: cannot fetch %s: %s", entry.name, e)
                continue
            if cache_digest(data) != entry.digest:
                logger.warning("compile cache: %s arrived damaged; not used", entry.name)
                continue
            os.makedirs(os.path.dirname(path), exist_ok=True)
            partial = os.path.join(os.path.dirname(path), f".dlrover-{os.getpid()}.tmp")
            with open(partial, "wb") as f:
                f.write(data)
            os.replace(partial, path)  # complete or absent, as torch's own writes
            self._done.add(entry.name)
            fetched += 1
            size += len(data)
        if fetched:
            logger.info(
                "compile cache: fetched %d files (%.1f MiB) of the job's from the master in "
                "%.1fs into %s", fetched, size / 2**20, time.monotonic() - began, self.folder
            )  # fmt: skip
        return fetched, size

    def _path(self, name: str) -> str:
        return os.path.join(self.folder, *checked_cache_name(name).split("/"))

    def _read(self, name: str, size: int) -> bytes:
        parts: list[bytes] = []
        offset = 0
        while offset < size:
            part = self._api.cache_read(name, offset, CACHE_CHUNK_BYTES)
            if not part:
                raise ValueError(f"the master's copy ends at {offset} of {size} bytes")
            parts.append(part)
            offset += len(part)
        return b"".join(parts)

    def push_new(self, now: float | None = None) -> int:
        """Send the files written here since the last scan that have settled (same size and time
        as at the previous scan): the number sent. A master that refuses a file (full, or
        another node sent it first) is not asked again for it; one that does not answer is
        asked again at the next scan."""
        with self._lock:
            now = time.time() if now is None else now
            sent = 0
            for name, size, mtime in self._scan():
                if name in self._done or _skipped(name):
                    continue
                settled = self._seen.get(name) == (size, mtime) and now - mtime / 1e9 >= 1.0
                self._seen[name] = (size, mtime)
                if not settled:
                    continue
                try:
                    with open(os.path.join(self.folder, *name.split("/")), "rb") as f:
                        data = f.read()
                    self._write(name, data)
                except MasterRequestError as e:
                    logger.debug("compile cache: the master keeps no copy of %s: %s", name, e)
                except OSError:
                    continue  # removed meanwhile: nothing to share
                except Exception as e:  # the master is away: the next scan tries again
                    logger.debug("compile cache: cannot send %s now: %s", name, e)
                    continue
                else:
                    sent += 1
                    self.pushed_files += 1
                    self.pushed_bytes += len(data)
                self._done.add(name)
            return sent

    def _scan(self) -> list[tuple[str, int, int]]:
        found = []
        for root, _, names in os.walk(self.folder):
            for base in names:
                path = os.path.join(root, base)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                name = os.path.relpath(path, self.folder).replace(os.sep, "/")
                found.append((name, st.st_size, st.st_mtime_ns))
        return found

    def _write(self, name: str, data: bytes) -> None:
        digest = cache_digest(data)
        for offset in range(0, max(len(data), 1), CACHE_CHUNK_BYTES):
            chunk = data[offset : offset + CACHE_CHUNK_BYTES]
            self._api.cache_write(name, len(data), digest, offset, chunk)

    def start(self) -> None:
        """Scan and send every ``interval_s`` in a thread of its own."""
        self._thread = threading.Thread(target=self._run, name="compile-cache-sync", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.push_new()

    def close(self, deadline_s: float = DEFAULT_CLOSE_DEADLINE_S) -> None:
        """Stop the thread and send what settled since its last scan (bounded)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(deadline_s)
        end = time.monotonic() + deadline_s
        # Two scans a settle apart: files written just before the close settle in between.
        self.push_new(now=time.time() + 1.0)
        while time.monotonic() < end and self.push_new(now=time.time() + 1.0):
            pass
        if self.pushed_files:
            logger.info(
                "compile cache: shared %d files (%.1f MiB) with the job through the master",
                self.pushed_files, self.pushed_bytes / 2**20,
            )  # fmt: skip
