"""The on-storage protocol: step directories, node parts, manifests, the "latest" marker."""

from __future__ import annotations

import json
import logging
import re
import zlib
from collections.abc import Callable
from typing import Any

from dlrover.checkpoint.config import (
    DEFAULT_KEEP_LAST,
    LATEST_FILE,
    MANIFEST_FILE,
    PERSIST_CHUNK_BYTES,
)
from dlrover.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointStorageError,
    SegmentStateError,
)
from dlrover.checkpoint.header import HEADER_SIZE, read_seq
from dlrover.checkpoint.shm import SharedSegment
from dlrover.checkpoint.storage import Storage

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step_(\d+)$")
FileTable = dict[str, dict[str, int]]  # file name -> {"size": n, "crc32": c}
Finalizer = Callable[["Catalog", int, list[dict[str, Any]]], FileTable]

# Layout of a checkpoint directory:
#   <dir>/step_<n>/rank_<p>.bin        tensor bytes of saving rank p (plain format)
#   <dir>/step_<n>/rank_<p>.meta.json  the segment metadata describing those bytes
#   <dir>/step_<n>/__*.distcp, .metadata   the DCP files (sharded format)
#   <dir>/step_<n>/node_<k>.json       the files node k wrote, with sizes and CRC32s
#   <dir>/step_<n>/manifest.json       all files of the step; written once every node is done
#   <dir>/latest                       the newest committed step; written last (temp + rename)


def step_dir(step: int) -> str:
    """The directory of ``step``, relative to the storage root: ``step_<n>``."""
    return f"step_{step}"


def crc32_file(storage: Storage, rel: str) -> tuple[int, int]:
    """(size, crc32) of a stored file, read in chunks."""
    crc, size = 0, 0
    with storage.open_read(rel) as f:
        while chunk := f.read(PERSIST_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


class Catalog:
    """Reads and writes checkpoint steps on one Storage; keeps the newest ``keep_last`` steps."""

    def __init__(self, storage: Storage, keep_last: int = DEFAULT_KEEP_LAST) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.storage = storage
        self.keep_last = keep_last

    # ------------------------------------------------------------------ writing
    def persist_plain_part(
        self, step: int, part: str, seg: SharedSegment, meta: dict[str, Any], seq: int
    ) -> FileTable:
        """Stream the data of ``seg`` (holding ``step`` at ``seq``) into the step directory."""
        rel = step_dir(step)
        self.storage.makedirs(rel)
        data_len = int(meta["data_len"])
        data = seg.buffer[HEADER_SIZE : HEADER_SIZE + data_len]
        try:
            crc = self.storage.write_from(f"{rel}/{part}.bin", data)
        finally:
            data.release()
        if read_seq(seg) != seq:
            raise SegmentStateError(f"segment {seg.path} was overwritten during the persist")
        meta_bytes = json.dumps(meta).encode()
        self.storage.write_atomic(f"{rel}/{part}.meta.json", meta_bytes)
        return {
            f"{part}.bin": {"size": data_len, "crc32": crc},
            f"{part}.meta.json": {"size": len(meta_bytes), "crc32": zlib.crc32(meta_bytes)},
        }

    def record_node_part(
        self, step: int, node_rank: int, files: FileTable, extra: dict[str, Any] | None = None
    ) -> None:
        """Record, atomically, the files node ``node_rank`` wrote for ``step`` (with ``extra`` for
        the committer's finalizer); ``commit`` merges these records into the manifest."""
        doc = {"step": step, "node_rank": node_rank, "files": files, "extra": extra or {}}
        self.storage.write_atomic(
            f"{step_dir(step)}/node_{node_rank}.json", json.dumps(doc).encode()
        )

    def commit(self, step: int, fmt: str, finalize: Finalizer | None = None) -> None:
        """Merge every node's part into the manifest, then move 'latest' (in that order). Older
        steps stay until ``collect_garbage`` (the saver calls it once the commit is announced).

        ``finalize(catalog, step, extras)`` may write more files (DCP's .metadata) from the
        nodes' ``extra`` documents before the manifest is written; it returns their entries.
        """
        rel = step_dir(step)
        files: FileTable = {}
        extras: list[dict[str, Any]] = []
        for name in self.storage.listdir(rel):
            if name.startswith("node_") and name.endswith(".json"):
                doc = json.loads(self.storage.read_bytes(f"{rel}/{name}"))
                files.update(doc["files"])
                extras.append(doc.get("extra", {}))
        if finalize is not None:
            files.update(finalize(self, step, extras))
        manifest = {"step": step, "format": fmt, "files": files}
        self.storage.write_atomic(f"{rel}/{MANIFEST_FILE}", json.dumps(manifest).encode())
        latest = self.latest_step()
        if latest is None or step > latest:
            self.storage.write_atomic(LATEST_FILE, str(step).encode())

    def collect_garbage(self) -> None:
        """Delete committed steps beyond the newest ``keep_last`` and stale uncommitted ones."""
        latest = self.latest_step()
        steps = self.steps()
        committed = [s for s in steps if self.storage.exists(f"{step_dir(s)}/{MANIFEST_FILE}")]
        keep = set(committed[-self.keep_last :])
        for s in steps:
            # Uncommitted steps newer than latest may still be in flight; leave them alone.
            if s not in keep and (latest is None or s < latest):
                self.storage.remove_tree(step_dir(s))

    # ------------------------------------------------------------------ reading
    def steps(self) -> list[int]:
        """Every step that has a directory, committed or not, ascending."""
        found = (_STEP_RE.match(n) for n in self.storage.listdir(""))
        return sorted(int(m.group(1)) for m in found if m)

    def latest_step(self) -> int | None:
        """The step the "latest" marker names; None if there is no marker or it is malformed
        (logged). Raises CheckpointStorageError if it cannot be read."""
        try:
            text = self.storage.read_bytes(LATEST_FILE).decode().strip()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CheckpointStorageError(
                f"cannot read {self.storage.url(LATEST_FILE)}: {exc}"
            ) from exc
        if not text.isdigit():
            log.warning("ignoring malformed marker %s: %r", self.storage.url(LATEST_FILE), text)
            return None
        return int(text)

    def manifest(self, step: int) -> dict[str, Any]:
        """The manifest of ``step``, not verified (see ``verify``); raises CheckpointCorruptError if
        it is missing (never committed) or not JSON."""
        rel = f"{step_dir(step)}/{MANIFEST_FILE}"
        try:
            manifest: dict[str, Any] = json.loads(self.storage.read_bytes(rel))
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(
                f"{self.storage.url(rel)} is missing: step {step} was never committed"
            ) from exc
        except ValueError as exc:
            raise CheckpointCorruptError(f"{self.storage.url(rel)} is not valid JSON") from exc
        return manifest

    def verify(self, step: int) -> dict[str, Any]:
        """The manifest of ``step`` after checking every file's size and CRC32."""
        manifest = self.manifest(step)
        for name, info in manifest["files"].items():
            rel = f"{step_dir(step)}/{name}"
            try:
                size, crc = crc32_file(self.storage, rel)
            except FileNotFoundError as exc:
                raise CheckpointCorruptError(f"{self.storage.url(rel)} is missing") from exc
            if size != info["size"] or crc != info["crc32"]:
                raise CheckpointCorruptError(
                    f"{self.storage.url(rel)} is corrupt: {size} bytes, crc32 {crc:#010x}; "
                    f"the manifest says {info['size']} bytes, crc32 {info['crc32']:#010x}"
                )
        return manifest

    def newest_valid(self, not_newer_than: int | None = None) -> tuple[int, dict[str, Any]] | None:
        """The newest committed step that verifies, warning about each one skipped."""
        latest = self.latest_step()
        bound = latest if not_newer_than is None else not_newer_than
        if bound is None:
            return None
        for step in sorted((s for s in self.steps() if s <= bound), reverse=True):
            try:
                return step, self.verify(step)
            except CheckpointCorruptError as exc:
                log.warning("checkpoint step %d is unusable (%s); trying an older step", step, exc)
        return None

    def load_plain_part(self, step: int, part: str, target: Any = None) -> Any:
        """Read ``part`` of a verified plain step back into a state dict (into ``target``)."""
        # Loading builds tensors, so torch is needed here (trainer side); the agent, which
        # only writes parts, imports this module without it.
        import torch

        from dlrover.checkpoint.layout import decode

        rel = step_dir(step)
        meta = json.loads(self.storage.read_bytes(f"{rel}/{part}.meta.json"))
        # Read into a bytearray and wrap it: no copy, and no numpy (an optional torch dependency).
        buffer = bytearray(int(meta["data_len"]))
        view = memoryview(buffer)
        with self.storage.open_read(f"{rel}/{part}.bin") as f:
            got = 0
            while got < len(view):
                n = f.readinto(view[got:])  # type: ignore[attr-defined]
                if not n:
                    raise CheckpointCorruptError(f"{self.storage.url(rel)}/{part}.bin is short")
                got += n
        data = (
            torch.frombuffer(buffer, dtype=torch.uint8)
            if buffer
            else torch.empty(0, dtype=torch.uint8)
        )
        return decode(meta, data, target, base=0)
