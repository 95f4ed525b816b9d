"""DeepSpeedCheckpointer: flash checkpoints of a DeepSpeed engine, in DeepSpeed's own layout."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
    CheckpointCommitInfo,
    CheckpointEngine,
)

from dlrover.checkpoint.catalog import Catalog, check_tag
from dlrover.checkpoint.errors import CheckpointError
from dlrover.checkpoint.formats import DEEPSPEED_NAMING
from dlrover.checkpoint.object_codec import decode_objects, encode_objects
from dlrover.checkpoint.torch_files import FILES_KEY, PERSIST_KEY, check_file_name
from dlrover.trainer.torch.flash_checkpoint.checkpointer import (
    DEFAULT_SAVE_TIMEOUT_S,
    Checkpointer,
    StorageType,
)

__all__ = ["DeepSpeedCheckpointer", "StorageType"]

log = logging.getLogger(__name__)

UNIVERSAL_DIR = ".dlrover-universal"
"""Where, under the checkpoint directory, a step converted to DeepSpeed's universal format is
kept (``<dir>/.dlrover-universal/<tag>``): a load at another data-parallel size reads it."""
UNIVERSAL_TIMEOUT_S = 1800.0
"""The longest a conversion to the universal format may take."""
_OPTIM_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


class _MemoryFiles(CheckpointEngine):  # type: ignore[misc]  # DeepSpeed's class is untyped
    """A DeepSpeed checkpoint engine that writes nothing: ``save`` keeps each state dict by its
    path, ``load`` answers from states given to it. DeepSpeed builds every file's state and
    names it (ZeRO shards, model states, client state); this engine only collects them."""

    def __init__(self, loads: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.name = "dlrover-flash"
        self.saved: dict[str, Any] = {}
        self._loads = loads or {}

    def create(self, info: CheckpointCommitInfo) -> None:
        """Nothing to prepare: the files go to shared memory."""

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        """No directories: the agent creates them when it persists."""

    def save(self, state_dict: Any, path: str) -> None:
        """Keep ``state_dict`` as the content of ``path``."""
        self.saved[os.path.normpath(path)] = state_dict

    def load(self, path: str, map_location: Any = None) -> Any:
        """The state kept for ``path``."""
        try:
            return self._loads[os.path.normpath(path)]
        except KeyError:
            raise CheckpointError(
                f"DeepSpeed asked for {path}, which the checkpoint in memory does not hold"
            ) from None

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Nothing to commit here: the agent's persist commits each step."""
        return True


class DeepSpeedCheckpointer(Checkpointer):
    """Flash checkpoints of a DeepSpeed engine (ZeRO stages 0-3), used in place of
    ``engine.save_checkpoint`` / ``engine.load_checkpoint``.

    A save lets DeepSpeed build every file it would write from this rank (through DeepSpeed's
    pluggable checkpoint engine, swapped in for the call), copies them into the agent's shared
    memory and, with DISK, the agent writes them with ``torch.save`` in DeepSpeed's layout:
    ``<dir>/global_step<n>/mp_rank_00_model_states.pt``, ZeRO's
    ``*zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (and, at stage 3, each rank's
    ``zero_pp_rank_<r>_mp_rank_00_model_states.pt``), then ``<dir>/latest`` = ``global_step<n>``
    once every rank's files are on storage. ``engine.load_checkpoint`` reads that directory.
    Each rank also keeps in memory the model states file only data-parallel rank 0 writes, so
    every rank can load from its own memory after a restart.
    """

    checkpoint_format = "deepspeed"

    def __init__(
        self,
        engine: Any,
        checkpoint_dir: str,
        comm_backend: str = "",
        deletion_strategy: Any = None,
        save_timeout: float = DEFAULT_SAVE_TIMEOUT_S,
        replica_count: int = 0,
        *,
        keep_last: int = 3,
    ) -> None:
        """``engine``: what ``deepspeed.initialize`` returned first; the rest as DdpCheckpointer's.
        MoE engines are refused (their expert files are not collected yet)."""
        if getattr(engine, "has_moe_layers", False):
            raise CheckpointError(
                "DeepSpeedCheckpointer does not save MoE layers yet; use engine.save_checkpoint"
            )
        super().__init__(
            checkpoint_dir,
            comm_backend=comm_backend,
            deletion_strategy=deletion_strategy,
            save_timeout=save_timeout,
            replica_count=replica_count,
            keep_last=keep_last,
        )
        self.ds_engine = engine
        self._warned_tag = False

    # ------------------------------------------------------------------ saving
    def save_checkpoint(
        self,
        save_dir: str = "",
        tag: Any = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        storage_type: StorageType = StorageType.DISK,
    ) -> bool:
        """As ``engine.save_checkpoint(save_dir, tag, client_state)``, into shared memory (and,
        with DISK, to ``save_dir`` in the background); every rank must call it (DeepSpeed's
        save has collectives). ``save_dir`` defaults to the checkpoint directory. ``tag``, as
        DeepSpeed's: any name (``str(tag)``: a step number, ``loss.item()``...; DeepSpeed's
        default ``global_step<n>`` when None) of the step's directory; the step this save holds
        is ``engine.global_steps`` (or n of a tag ``global_step<n>``), and a later save under
        the same tag replaces it. Ranks that pass different tags (``loss.item()`` of each
        rank's own loss) save under rank 0's, with a warning: DeepSpeed itself would scatter
        the step over several directories. ``save_latest`` is accepted: ``latest`` (holding the tag) is
        always written, last, when a step is on storage. Returns True (no save is skipped) or
        raises CheckpointError."""
        del save_latest  # the agent's commit moves `latest`
        save_dir = save_dir or self.checkpoint_dir
        tag, step = self._tag_and_step(tag)
        engine = self.ds_engine
        collector = _MemoryFiles()
        own_engine, writes_model = engine.checkpoint_engine, engine.save_non_zero_checkpoint
        engine.checkpoint_engine = collector
        # Every rank builds the model states file (only data-parallel rank 0 writes it): a
        # restarted rank then loads it from its own memory.
        engine.save_non_zero_checkpoint = True
        try:
            engine.save_checkpoint(
                save_dir, tag, client_state=client_state or {}, save_latest=False
            )
        finally:
            engine.checkpoint_engine = own_engine
            engine.save_non_zero_checkpoint = writes_model
        step_path = os.path.normpath(os.path.join(save_dir, tag))
        files: dict[str, Any] = {}
        for path, state in collector.saved.items():
            name = os.path.relpath(path, step_path).replace(os.sep, "/")
            files[check_file_name(name)] = encode_objects(state)
        # Storage gets what DeepSpeed would have written from this rank: the model states file
        # only where DeepSpeed writes it (data-parallel rank 0 below ZeRO-3).
        persist = [n for n in files if writes_model or not n.endswith("_model_states.pt")]
        state = {"tag": tag, FILES_KEY: files, PERSIST_KEY: persist}
        return self._engine_for(save_dir).save(
            step, state, persist=storage_type == StorageType.DISK
        )

    def _tag_and_step(self, tag: Any) -> tuple[str, int]:
        """(the directory name, the step number) of a save under ``tag``."""
        if tag is None:
            step = int(self.ds_engine.global_steps)
            return DEEPSPEED_NAMING.dir(step), step
        own = check_tag(str(tag))
        name = _rank0_tag(own)
        if name != own and not self._warned_tag:
            log.warning(
                "save_checkpoint: this rank's tag %r differs from rank 0's %r; steps are saved "
                "under rank 0's tags (give every rank the same tag)",
                own,
                name,
            )
            self._warned_tag = True
        numbered = DEEPSPEED_NAMING.parse_dir(name)
        return name, int(self.ds_engine.global_steps) if numbered is None else numbered

    # ------------------------------------------------------------------ loading
    def load_checkpoint(
        self,
        load_dir: str = "",
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """As ``engine.load_checkpoint``: (the loaded step's directory, the client state), or
        (None, None) when there is no checkpoint. Every rank must call it. Without ``tag``, the
        newest step: from shared memory when every rank holds one not older than storage's
        (``latest``), else the newest step on storage that verifies, read by DeepSpeed's own
        loader; a ``tag`` loads the step saved under it from storage (CheckpointError when
        ``load_dir`` holds no such step)."""
        load_dir = load_dir or self.checkpoint_dir
        resume_path = ""
        if tag is not None:
            name = check_tag(str(tag))
            catalog = self._engine_for(load_dir).catalog() if load_dir else None
            if catalog is None or catalog.step_named(name) is None:
                raise CheckpointError(
                    f"{load_dir} holds no checkpoint tagged {name!r}: its steps are "
                    f"{_tags_of(catalog)}"
                )
            resume_path = os.path.join(load_dir, name)
        elif os.path.abspath(load_dir) != os.path.abspath(self.checkpoint_dir):
            resume_path = load_dir
        found = self._load_newest(resume_path, None)
        if found is None:
            return None, None
        step, state = found
        options = {
            "load_module_strict": load_module_strict,
            "load_optimizer_states": load_optimizer_states,
            "load_lr_scheduler_states": load_lr_scheduler_states,
            "load_module_only": load_module_only,
            "custom_load_fn": custom_load_fn,
        }
        if self.last_load_source == "storage":
            step_dir = str(state["dir"])
            saved = _saved_dp_size(step_dir)
            now = int(getattr(self.ds_engine, "dp_world_size", 1))
            if saved and saved != now and self.ds_engine.zero_optimization_stage() > 0:
                return step_dir, self._load_resharded(step_dir, saved, now, options)
            _, client_state = self.ds_engine.load_checkpoint(
                os.path.dirname(step_dir), os.path.basename(step_dir), **options
            )
            return step_dir, client_state
        tag = str(state.get("tag") or DEEPSPEED_NAMING.dir(step))
        return self._load_from_memory_files(load_dir, tag, state[FILES_KEY], options)

    def _load_resharded(
        self, step_dir: str, saved: int, now: int, options: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Load a step saved at data-parallel size ``saved`` into this engine of size ``now``:
        DeepSpeed's own `ds_to_universal` converts it once (rank 0, into
        ``<dir>/.dlrover-universal/<tag>``), and DeepSpeed's universal load reads the
        conversion, re-partitioning the ZeRO optimizer state over this job's ranks."""
        tag = os.path.basename(step_dir)
        target = os.path.join(os.path.dirname(step_dir), UNIVERSAL_DIR, tag)
        log.warning(
            "%s was saved by %d data-parallel ranks, this job has %d: loading it through "
            "DeepSpeed's universal checkpoint format (converted once into %s)",
            step_dir, saved, now, target,
        )  # fmt: skip
        error = ""
        if _rank() == 0 and not _converted(step_dir, target):
            error = _convert_to_universal(step_dir, target)
        shared = _rank0_text(error)  # every rank fails alike, rank 0 with the whole message
        if shared:
            raise CheckpointError(error or shared)
        engine = self.ds_engine
        universal = engine._config.load_universal_checkpoint
        engine._config.load_universal_checkpoint = True
        try:
            _, client_state = engine.load_checkpoint(os.path.dirname(target), tag, **options)
        finally:
            engine._config.load_universal_checkpoint = universal
        return client_state  # type: ignore[no-any-return]

    def _load_from_memory_files(
        self, load_dir: str, tag: str, files: dict[str, Any], options: dict[str, Any]
    ) -> tuple[str, dict[str, Any] | None]:
        """Run DeepSpeed's own load over the files held in memory: DeepSpeed finds the model
        states files by listing the step directory, so empty files stand in for their names in
        a temporary directory, and the swapped-in checkpoint engine answers each read."""
        engine = self.ds_engine
        with tempfile.TemporaryDirectory(prefix="dlrover-ds-load-") as root:
            loads = {}
            for name, content in files.items():
                path = os.path.normpath(os.path.join(root, tag, name))
                os.makedirs(os.path.dirname(path), exist_ok=True)
                open(path, "wb").close()
                loads[path] = decode_objects(content)
            own_engine = engine.checkpoint_engine
            engine.checkpoint_engine = _MemoryFiles(loads)
            try:
                _, client_state = engine.load_checkpoint(root, tag, **options)
            finally:
                engine.checkpoint_engine = own_engine
        return os.path.join(load_dir, tag), client_state


def _saved_dp_size(step_dir: str) -> int:
    """How many data-parallel ranks saved the step: its ZeRO optimizer files (0: none)."""
    try:
        names = os.listdir(step_dir)
    except OSError:
        return 0
    ranks = {int(m.group(1)) for m in map(_OPTIM_FILE.search, names) if m}
    return len(ranks)


def _converted(step_dir: str, target: str) -> bool:
    """Whether ``target`` holds a conversion of the step as it is now: made after its files
    were last written (a later save under the same tag replaces the step; convert it again)."""
    try:
        made = os.path.getmtime(target)
        written = max(os.path.getmtime(os.path.join(step_dir, n)) for n in os.listdir(step_dir))
    except (OSError, ValueError):
        return False
    return made >= written


def _convert_to_universal(step_dir: str, target: str) -> str:
    """Run DeepSpeed's ``ds_to_universal`` on ``step_dir`` into ``target`` (written aside and
    renamed, so a half-done conversion is never read); the error in words, or ""."""
    staging = f"{target}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    command = [
        sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
        "--input_folder", step_dir, "--output_folder", staging,
        "--inject_missing_state",  # a plain engine's files carry no universal_checkpoint_info
    ]  # fmt: skip
    started = time.monotonic()
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=UNIVERSAL_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        shutil.rmtree(staging, ignore_errors=True)
        return (
            f"converting {step_dir} to DeepSpeed's universal format took more than "
            f"{UNIVERSAL_TIMEOUT_S:.0f}s; load it at the data-parallel size it was saved with"
        )
    if done.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return (
            f"cannot load {step_dir} at another data-parallel size: DeepSpeed's ds_to_universal "
            f"failed (exit {done.returncode}): {' | '.join(tail)}"
        )
    shutil.rmtree(target, ignore_errors=True)  # an older conversion of the tag
    os.replace(staging, target)
    for other in os.listdir(os.path.dirname(target)):  # one conversion kept: the newest
        if other != os.path.basename(target):
            shutil.rmtree(os.path.join(os.path.dirname(target), other), ignore_errors=True)
    log.warning(
        "converted %s to the universal format in %.1fs", step_dir, time.monotonic() - started
    )
    return ""


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _rank0_text(text: str) -> str:
    """Rank 0's ``text`` (cut to 255 bytes) on every rank; "" for none."""
    return _rank0_tag(text.encode()[:_MAX_TAG_BYTES].decode(errors="ignore"))


def _tags_of(catalog: Catalog | None) -> str:
    if catalog is None:
        return "none"
    names = [catalog.step_dir(step) for step in catalog.steps()]
    return ", ".join(repr(n) for n in names) or "none"


_MAX_TAG_BYTES = 255


def _rank0_tag(tag: str) -> str:
    """Rank 0's ``tag`` on every rank (one broadcast of a small tensor)."""
    import torch
    import torch.distributed as dist

    data = tag.encode()
    if len(data) > _MAX_TAG_BYTES:
        raise CheckpointError(f"tag {tag[:40]!r}... is longer than {_MAX_TAG_BYTES} bytes")
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return tag
    device = torch.device("cpu")
    if "nccl" in str(dist.get_backend()):
        device = torch.device("cuda", torch.cuda.current_device())
    buf = torch.zeros(_MAX_TAG_BYTES + 1, dtype=torch.uint8)
    buf[0] = len(data)
    buf[1 : 1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(device)
    dist.broadcast(buf, src=0)
    got = buf.cpu()
    return bytes(got[1 : 1 + int(got[0])].tolist()).decode()
