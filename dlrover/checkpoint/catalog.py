"""The on-storage protocol: step directories, node parts, manifests, the "latest" marker."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from dlrover.checkpoint.config import (
    DEFAULT_KEEP_LAST,
    LATEST_FILE,
    MANIFEST_FILE,
    PERSIST_CHUNK_BYTES,
)
from dlrover.checkpoint.crc import crc32
from dlrover.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointStorageError,
    SegmentStateError,
)
from dlrover.checkpoint.header import HEADER_SIZE, read_seq
from dlrover.checkpoint.read_ranges import READ_THREADS, ShortFileError
from dlrover.checkpoint.shm import SharedSegment
from dlrover.checkpoint.storage import Storage

log = logging.getLogger(__name__)

FileTable = dict[str, dict[str, int]]  # file name -> {"size": n, "crc32": c}
Finalizer = Callable[["Catalog", int, list[dict[str, Any]]], FileTable]

# Layout of a checkpoint directory:
#   <dir>/step_<n>/rank_<p>.bin        tensor bytes of saving rank p (plain format)
#   <dir>/step_<n>/rank_<p>.meta.json  the segment metadata describing those bytes
#   <dir>/step_<n>/__*.distcp, .metadata   the DCP files (sharded format)
#   <dir>/step_<n>/node_<k>.json       the files node k wrote, with sizes and CRC32s
#   <dir>/step_<n>/manifest.json       all files of the step; written once every node is done
#   <dir>/latest                       the newest committed step; written last (temp + rename)
# A format may name the step directories and the marker as its framework does (StepNaming):
# DeepSpeed's global_step<n>/ and "latest" holding "global_step<n>", Megatron-LM's iter_<n:07>/
# and latest_checkpointed_iteration.txt holding "<n>".


@dataclass(frozen=True)
class StepNaming:
    """How a format names each step's directory and the marker of the newest committed step:
    ``<dir_prefix><step, zero-padded to digits>`` and ``latest_file`` holding
    ``<latest_prefix><step>``. The default is ours: ``step_<n>`` and ``latest`` = ``<n>``."""

    dir_prefix: str = "step_"
    digits: int = 0
    latest_file: str = LATEST_FILE
    latest_prefix: str = ""
    tagged: bool = False
    """Steps may also be named by the user (DeepSpeed's ``tag``): the directory of such a step
    is its tag, and the marker holds the tag; the catalog records which step each tag holds in
    ``TAGS_FILE`` (the tag's text alone says nothing of its step: ``tag=loss.item()``)."""

    def dir(self, step: int) -> str:
        """The directory of ``step``, relative to the storage root."""
        return f"{self.dir_prefix}{step:0{self.digits}d}"

    def parse_dir(self, name: str) -> int | None:
        """The step a directory named ``name`` holds; None if it is not a step directory."""
        match = re.fullmatch(re.escape(self.dir_prefix) + r"(\d+)", name)
        return int(match.group(1)) if match else None

    def latest_text(self, step: int) -> str:
        """What the marker holds once ``step`` is the newest committed one."""
        return f"{self.latest_prefix}{step}"

    def parse_latest(self, text: str) -> int | None:
        """The step the marker's ``text`` names; None if malformed."""
        if not text.startswith(self.latest_prefix):
            return None
        rest = text[len(self.latest_prefix) :]
        return int(rest) if rest.isdigit() else None


TAGS_FILE = ".dlrover-tags.json"
"""Of a tagged naming: ``{"<step>": "<its directory>"}`` for every step saved under a tag."""


def check_tag(tag: str) -> str:
    """``tag`` if it can name a step directory (one path component, not hidden, not the
    marker's name); CheckpointError otherwise."""
    from dlrover.checkpoint.errors import CheckpointError

    if not tag or "/" in tag or "\\" in tag or tag in (".", "..") or tag.startswith("."):
        raise CheckpointError(
            f"tag {tag!r} cannot name a checkpoint directory: give one path component that "
            "does not start with '.'"
        )
    return tag


DEFAULT_NAMING = StepNaming()
"""``step_<n>`` directories and ``latest`` holding ``<n>`` (the plain and DCP formats)."""


def step_dir(step: int) -> str:
    """The directory of ``step`` in the default naming, relative to the storage root."""
    return DEFAULT_NAMING.dir(step)


def crc32_file(storage: Storage, rel: str) -> tuple[int, int]:
    """(size, crc32) of a stored file, read in chunks."""
    crc, size = 0, 0
    with storage.open_read(rel) as f:
        while chunk := f.read(PERSIST_CHUNK_BYTES):
            crc = crc32(chunk, crc)
            size += len(chunk)
    return size, crc


class Catalog:
    """Reads and writes checkpoint steps on one Storage; keeps the newest ``keep_last`` steps."""

    def __init__(
        self,
        storage: Storage,
        keep_last: int = DEFAULT_KEEP_LAST,
        naming: StepNaming = DEFAULT_NAMING,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {keep_last}")
        self.storage = storage
        self.keep_last = keep_last
        self.naming = naming
        self._tags: dict[int, str] = {}

    def step_dir(self, step: int) -> str:
        """The directory of ``step``, relative to the storage root (in this catalog's naming):
        its tag where it was saved under one."""
        if self.naming.tagged:
            if step not in self._tags:
                self._read_tags()
            if step in self._tags:
                return self._tags[step]
        return self.naming.dir(step)

    # ------------------------------------------------------------------ tags
    def _read_tags(self) -> dict[int, str]:
        try:
            doc = json.loads(self.storage.read_bytes(TAGS_FILE))
        except FileNotFoundError:
            doc = {}
        except (OSError, ValueError) as exc:
            log.warning("ignoring unreadable %s: %s", self.storage.url(TAGS_FILE), exc)
            doc = {}
        self._tags = {int(step): str(tag) for step, tag in doc.items() if str(step).isdigit()}
        return self._tags

    def name_step(self, step: int, tag: str) -> None:
        """Record that ``step`` is stored under ``tag`` (a tagged naming only). A tag that held
        another step names this one from now on (its directory is written over, as the
        framework's own save would)."""
        if not self.naming.tagged:
            raise ValueError(f"steps of this catalog are named {self.naming.dir(step)!r}")
        check_tag(tag)
        tags = self._read_tags()
        if tags.get(step) == tag:
            return
        tags = {s: t for s, t in tags.items() if t != tag}
        tags[step] = tag
        doc = {str(s): t for s, t in sorted(tags.items())}
        self.storage.write_atomic(TAGS_FILE, json.dumps(doc).encode())
        self._tags = tags

    def step_named(self, name: str) -> int | None:
        """The step a directory called ``name`` holds (its tag, or the naming's name)."""
        if self.naming.tagged:
            for step, tag in self._read_tags().items():
                if tag == name:
                    return step
        return self.naming.parse_dir(name)

    # ------------------------------------------------------------------ writing
    def persist_plain_part(
        self, step: int, part: str, seg: SharedSegment, meta: dict[str, Any], seq: int
    ) -> FileTable:
        """Stream the data of ``seg`` (holding ``step`` at ``seq``) into the step directory."""
        rel = self.step_dir(step)
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
            f"{part}.meta.json": {"size": len(meta_bytes), "crc32": crc32(meta_bytes)},
        }

    def record_node_part(
        self, step: int, node_rank: int, files: FileTable, extra: dict[str, Any] | None = None
    ) -> None:
        """Record, atomically, the files node ``node_rank`` wrote for ``step`` (with ``extra`` for
        the committer's finalizer); ``commit`` merges these records into the manifest."""
        doc = {"step": step, "node_rank": node_rank, "files": files, "extra": extra or {}}
        self.storage.write_atomic(
            f"{self.step_dir(step)}/node_{node_rank}.json", json.dumps(doc).encode()
        )

    def commit(self, step: int, fmt: str, finalize: Finalizer | None = None) -> None:
        """Merge every node's part into the manifest, then move 'latest' (in that order). Older
        steps stay until ``collect_garbage`` (the saver calls it once the commit is announced).

        ``finalize(catalog, step, extras)`` may write more files (DCP's .metadata) from the
        nodes' ``extra`` documents before the manifest is written; it returns their entries.
        """
        rel = self.step_dir(step)
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
            text = rel if self.naming.tagged else self.naming.latest_text(step)
            self.storage.write_atomic(self.naming.latest_file, text.encode())

    def collect_garbage(self) -> None:
        """Delete committed steps beyond the newest ``keep_last`` and stale uncommitted ones."""
        latest = self.latest_step()
        steps = self.steps()
        committed = [s for s in steps if self.storage.exists(f"{self.step_dir(s)}/{MANIFEST_FILE}")]
        keep = set(committed[-self.keep_last :])
        for s in steps:
            # Uncommitted steps newer than latest may still be in flight; leave them alone.
            if s not in keep and (latest is None or s < latest):
                self.storage.remove_tree(self.step_dir(s))

    # ------------------------------------------------------------------ reading
    def steps(self) -> list[int]:
        """Every step that has a directory, committed or not, ascending."""
        names = self.storage.listdir("")
        found = {self.naming.parse_dir(n) for n in names}
        if self.naming.tagged:
            present = set(names)
            found.update(step for step, tag in self._read_tags().items() if tag in present)
            # A name the naming parses but a tag now holds another step: not that step.
            found = {s for s in found if s is None or self.step_dir(s) in present}
        return sorted(step for step in found if step is not None)

    def latest_step(self) -> int | None:
        """The step the "latest" marker names; None if there is no marker or it is malformed
        (logged). Raises CheckpointStorageError if it cannot be read."""
        marker = self.naming.latest_file
        try:
            text = self.storage.read_bytes(marker).decode().strip()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise CheckpointStorageError(f"cannot read {self.storage.url(marker)}: {exc}") from exc
        step = self.step_named(text) if self.naming.tagged else None
        if step is None:
            step = self.naming.parse_latest(text)
        if step is None:
            log.warning("ignoring malformed marker %s: %r", self.storage.url(marker), text)
        return step

    def manifest(self, step: int) -> dict[str, Any]:
        """The manifest of ``step``, not verified (see ``verify``); raises CheckpointCorruptError if
        it is missing (never committed) or not JSON."""
        rel = f"{self.step_dir(step)}/{MANIFEST_FILE}"
        try:
            manifest: dict[str, Any] = json.loads(self.storage.read_bytes(rel))
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(
                f"{self.storage.url(rel)} is missing: step {step} was never committed"
            ) from exc
        except ValueError as exc:
            raise CheckpointCorruptError(f"{self.storage.url(rel)} is not valid JSON") from exc
        return manifest

    def verify(self, step: int, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
        """The manifest of ``step`` after checking the size and CRC32 of every file but those
        named in ``skip``; files are read concurrently, large ones in parallel ranges."""
        manifest = self.manifest(step)
        names = [n for n in manifest["files"] if n not in skip]
        if not names:
            return manifest

        def check(name: str) -> None:
            info = manifest["files"][name]
            rel = f"{self.step_dir(step)}/{name}"
            try:
                size, crc = self.storage.checksum(rel)
            except FileNotFoundError as exc:
                raise CheckpointCorruptError(f"{self.storage.url(rel)} is missing") from exc
            _check(self.storage.url(rel), size, crc, info)

        with ThreadPoolExecutor(
            min(len(names), READ_THREADS), thread_name_prefix="ckpt-verify"
        ) as pool:
            for done in [pool.submit(check, name) for name in names]:
                done.result()  # the first failure, in manifest order
        return manifest

    def newest_valid(self, not_newer_than: int | None = None) -> tuple[int, dict[str, Any]] | None:
        """The newest committed step that verifies, warning about each one skipped."""
        for step in self._candidates(not_newer_than):
            try:
                return step, self.verify(step)
            except CheckpointCorruptError as exc:
                log.warning("checkpoint step %d is unusable (%s); trying an older step", step, exc)
        return None

    def _candidates(self, not_newer_than: int | None) -> list[int]:
        """Steps not newer than the bound (default: the "latest" marker), newest first."""
        latest = self.latest_step()
        bound = latest if not_newer_than is None else not_newer_than
        if bound is None:
            return []
        return sorted((s for s in self.steps() if s <= bound), reverse=True)

    def load_newest_plain(
        self, part: str, target: Any = None, not_newer_than: int | None = None
    ) -> tuple[int, Any] | None:
        """(step, state) of the newest committed plain step whose ``part`` reads back intact,
        warning about each one skipped; None when there is none.

        Each step is read once, straight into ``target``'s tensors and checked while it is read
        (``load_plain_part``). A step that fails its check after bytes landed in ``target`` is
        overwritten by the older step loaded next; if that older step does not cover every such
        tensor, or no step is intact, CheckpointCorruptError says so (``target`` then holds
        bytes of a corrupt step and must be rebuilt).
        """
        dirty: set[int] = set()
        failed: list[int] = []
        for step in self._candidates(not_newer_than):
            try:
                state, written = self._read_plain(step, part, target, dirty)
            except CheckpointCorruptError as exc:
                log.warning("checkpoint step %d is unusable (%s); trying an older step", step, exc)
                failed.append(step)
                continue
            if dirty - written:
                raise CheckpointCorruptError(
                    f"step {step} of {self.storage.root} was loaded, but {len(dirty - written)} "
                    f"tensors of the target still hold bytes of corrupt step(s) {failed} that step "
                    f"{step} does not have; rebuild the model and optimizer before loading"
                )
            return step, state
        if dirty:
            raise CheckpointCorruptError(
                f"no committed step of {self.storage.root} is intact (tried {failed}), and the "
                f"read of the newest wrote into {len(dirty)} tensors of the target; rebuild the "
                "model and optimizer before training without a checkpoint"
            )
        return None

    def load_plain_part(self, step: int, part: str, target: Any = None) -> Any:
        """Read ``part`` of plain ``step`` into a state dict (into ``target``'s tensors where
        they match), checking every file of the step against its manifest as it is read;
        CheckpointCorruptError if one does not match (``target`` may then hold some of its
        bytes: see ``load_newest_plain``)."""
        return self._read_plain(step, part, target, set())[0]

    def _read_plain(
        self, step: int, part: str, target: Any, dirty: set[int]
    ) -> tuple[Any, set[int]]:
        """(state, addresses of the target tensors it wrote); on a failed check after the read
        began, the addresses it wrote go into ``dirty`` before CheckpointCorruptError."""
        # Loading builds tensors, so torch is needed here (trainer side); the agent, which
        # only writes parts, imports this module without it.
        from dlrover.checkpoint.part_reader import plan_part

        rel = self.step_dir(step)
        files = self.manifest(step)["files"]
        data_name, meta_name = f"{part}.bin", f"{part}.meta.json"
        for name in (data_name, meta_name):
            if name not in files:
                raise CheckpointCorruptError(
                    f"the manifest of {self.storage.url(rel)} does not list {name}"
                )
        # The small files first (metadata, other parts' files): the target is only written once
        # everything else of the step has checked out.
        self.verify(step, skip=frozenset({data_name, meta_name}))
        meta_url = self.storage.url(f"{rel}/{meta_name}")
        try:
            meta_bytes = self.storage.read_bytes(f"{rel}/{meta_name}")
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"{meta_url} is missing") from exc
        _check(meta_url, len(meta_bytes), crc32(meta_bytes), files[meta_name])
        meta = json.loads(meta_bytes)
        data_rel, info = f"{rel}/{data_name}", files[data_name]
        data_url = self.storage.url(data_rel)
        try:
            size = self.storage.size(data_rel)
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"{data_url} is missing") from exc
        if size != info["size"] or size != int(meta["data_len"]):
            raise CheckpointCorruptError(
                f"{data_url} is corrupt: {size} bytes; the manifest says {info['size']} bytes "
                f"and the metadata {meta['data_len']}"
            )
        plan = plan_part(meta, target)
        try:
            crc = self.storage.read_into(data_rel, plan.spans)
        except (ShortFileError, FileNotFoundError) as exc:
            dirty.update(plan.written)
            raise CheckpointCorruptError(f"{data_url} is corrupt: {exc}") from exc
        except OSError as exc:
            dirty.update(plan.written)
            raise CheckpointStorageError(f"cannot read {data_url}: {exc}") from exc
        except BaseException:
            dirty.update(plan.written)
            raise
        if crc != info["crc32"]:
            dirty.update(plan.written)
            _check(data_url, size, crc, info)
        return plan.finish(), plan.written


def _check(url: str, size: int, crc: int, info: dict[str, int]) -> None:
    """CheckpointCorruptError unless ``size`` and ``crc`` are what the manifest ``info`` says."""
    if size != info["size"] or crc != info["crc32"]:
        raise CheckpointCorruptError(
            f"{url} is corrupt: {size} bytes, crc32 {crc:#010x}; "
            f"the manifest says {info['size']} bytes, crc32 {info['crc32']:#010x}"
        )
