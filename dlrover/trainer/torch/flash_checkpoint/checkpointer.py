"""What every flash checkpointer offers, and where a save goes (StorageType)."""

from __future__ import annotations

import enum
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dlrover.checkpoint.catalog import Catalog
from dlrover.checkpoint.engine import CheckpointEngine
from dlrover.checkpoint.errors import SegmentStateError
from dlrover.checkpoint.saver_messages import HeldRequest
from dlrover.checkpoint.storage import storage_for
from dlrover.constants import ENV_CHECKPOINT_SOCKET
from dlrover.hang_spec import CHECKPOINT
from dlrover.trainer.progress import section

log = logging.getLogger(__name__)

_FILE_SUFFIXES = frozenset({".pt", ".pth", ".bin", ".ckpt", ".safetensors"})


DEFAULT_SAVE_TIMEOUT_S = 600.0
"""DLRover's default ``save_timeout``, accepted and not needed (see Checkpointer)."""


@dataclass(frozen=True)
class KeepLatestStepStrategy:
    """DLRover's deletion strategy that keeps the newest ``max_to_keep`` steps on storage; here
    it sets the checkpointer's ``keep_last``."""

    max_to_keep: int
    checkpoint_dir: str = ""


class StorageType(enum.Enum):
    """MEMORY: copy into the agent's shared memory only (survives a worker crash, not a node
    loss). DISK: the same copy, then the agent persists it to storage in the background."""

    MEMORY = "memory"
    DISK = "disk"


class Checkpointer:
    """Base of the trainer-facing checkpointers; owns one CheckpointEngine per directory.

    ``checkpoint_format`` names the format of ``dlrover.checkpoint.formats`` a subclass saves
    in. Every subclass loads through ``_load_newest``, the one memory -> storage ladder; it
    only says what to load into and whether this rank reads at all.
    """

    checkpoint_format: str = "plain"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every checkpointer's save and load is the ``checkpoint`` phase for hang detection
        (judged against its own learned timeout, not the step's)."""
        super().__init_subclass__(**kwargs)
        for name in ("save_checkpoint", "load_checkpoint"):
            method = cls.__dict__.get(name)
            if method is not None and not getattr(method, "_marks_section", False):
                marked = section(CHECKPOINT)(method)
                marked._marks_section = True  # type: ignore[attr-defined]
                setattr(cls, name, marked)

    def __init__(
        self,
        checkpoint_dir: str,
        local_shard_num: int = 1,
        global_shard_num: int = 1,
        comm_backend: str = "",
        deletion_strategy: Any = None,
        save_timeout: float = DEFAULT_SAVE_TIMEOUT_S,
        replica_count: int = 0,
        *,
        keep_last: int = 3,
    ) -> None:
        """DLRover's arguments, in DLRover's order, plus ``keep_last`` (steps kept on storage).

        ``replica_count`` >= 1 also keeps each memory save in peer nodes' memory, so that a
        replaced node restores from a peer instead of from storage (see docs/checkpoint.md).
        ``deletion_strategy``: an object with ``max_to_keep`` (DLRover's
        ``KeepLatestStepStrategy``) sets ``keep_last``. ``comm_backend`` and ``save_timeout``
        are accepted for DLRover's scripts and not needed: saves need no process group of their
        own, and a step is committed once every rank's part is on storage.
        ``local_shard_num``/``global_shard_num`` above 1 (each rank saving its own part of a
        model-parallel state) are refused: use FsdpShardCheckpointer for sharded state."""
        if local_shard_num != 1 or global_shard_num != 1:
            raise ValueError(
                f"local_shard_num={local_shard_num}, global_shard_num={global_shard_num}: "
                f"{type(self).__name__} saves one state every rank holds alike; for state sharded "
                f"over ranks use FsdpShardCheckpointer (DCP format)"
            )
        if deletion_strategy is not None:
            keep = getattr(
                deletion_strategy, "max_to_keep", getattr(deletion_strategy, "_max_to_keep", None)
            )
            if isinstance(keep, int) and keep > 0:
                keep_last = keep
            else:
                log.warning(
                    "deletion_strategy %r is not supported; keeping the last %d steps "
                    "(give keep_last= or KeepLatestStepStrategy(max_to_keep))",
                    deletion_strategy,
                    keep_last,
                )
        del comm_backend, save_timeout  # accepted for DLRover's scripts; see above
        self.checkpoint_dir = checkpoint_dir
        self.keep_last = keep_last
        self.replica_count = replica_count
        self._engines: dict[str, CheckpointEngine] = {}
        self._warned_file_path = False
        self.last_load_source: str | None = None
        """Where the last load came from: "memory", "storage", or None (nothing found)."""
        self.engine = self._engine_for("")

    def _engine_for(self, path: str) -> CheckpointEngine:
        if path and os.path.splitext(path)[1] in _FILE_SUFFIXES:
            # DLRover's scripts pass the file a step would be written to
            # (f"/ckpt/{step}/rank_0.pt"); steps are stored as step_<n>/ under
            # checkpoint_dir here, and an engine (with its shared memory) per step would pile up.
            if not self._warned_file_path:
                log.warning(
                    "save_checkpoint(path=%r): a file path; saving under %s/step_<n> instead "
                    "(load_checkpoint() finds it there)",
                    path,
                    self.checkpoint_dir,
                )
                self._warned_file_path = True
            path = ""
        key = path or self.checkpoint_dir
        if key not in self._engines:
            self._engines[key] = CheckpointEngine(
                key, self.checkpoint_format, self.keep_last, replica_count=self.replica_count
            )
        return self._engines[key]

    @property
    def restored_from_peer(self) -> int | None:
        """After a load from memory: the peer node whose memory this node's copy came from
        (this node had lost its own, see ``replica_count``); None otherwise."""
        return self.engine.restored_from_peer if self.last_load_source == "memory" else None

    def _from_memory_note(self) -> str:
        peer = self.engine.restored_from_peer
        return "" if peer is None else f" (copied from node {peer}'s memory)"

    def newest_step_held(self) -> int | None:
        """The newest step this node could resume from, asking nobody else: its agent's shared
        memory (under dlrover-run) or storage; None when neither holds one. A load may still
        pick an older step (every rank must hold the memory step)."""
        steps: list[int] = []
        latest = storage_step(self.engine.catalog())
        if latest is not None:
            steps.append(latest)
        if os.environ.get(ENV_CHECKPOINT_SOCKET):
            held = self.engine.client.request(HeldRequest()).steps
            steps.extend(step for step in held.values() if step is not None)
        return max(steps) if steps else None

    def _load_newest(
        self, resume_path: str, target: Any, reads: bool = True
    ) -> tuple[int, Any] | None:
        """(step, state) of the newest checkpoint, or None when there is none; sets
        ``last_load_source``. The load of every checkpointer:

        1. storage's latest committed step (of ``resume_path`` when given: a checkpoint
           directory or one of its ``step_<n>`` directories, which bounds the step);
        2. without ``resume_path``, the step every rank agrees to load from memory (the
           agent's shared memory, or a peer's), if not older than storage's: every rank takes
           part in this vote, so it is asked even where ``reads`` is False;
        3. that step from memory, into ``target``'s tensors, kept only if every rank loaded
           it (one all-reduce); should memory fail on any rank, or hold nothing, the newest
           intact step from storage, read by the engine's format, on every rank.

        ``reads`` False: this rank only votes (its state comes from another rank) and gets None.
        """
        engine = self.engine
        self.last_load_source = None
        catalog, bound = resolve_catalog(engine, resume_path)
        latest = storage_step(catalog)
        in_memory = None if resume_path else engine.memory_step(latest)
        from_memory: tuple[int, Any] | None = None
        if in_memory is not None and reads:
            try:
                step, state, _ = engine.load_from_memory(target, in_memory)
                from_memory = step, state
            except SegmentStateError as exc:
                log.warning("cannot load step %d from memory (%s)", in_memory, exc)
        # Every rank voted, so every rank is here with the same `in_memory`: agree that every
        # reader holds it before anyone trains on it (a peer gone between the vote and the
        # load fails one rank's load, and that rank alone would go back to storage's step).
        if in_memory is not None and not every_rank_holds(from_memory is not None or not reads):
            log.warning(
                "step %d could not be loaded from memory by every rank; every rank loads "
                "from storage instead, so that all resume from one step",
                in_memory,
            )
            from_memory = None
        if not reads:
            return None
        if from_memory is not None:
            log.info(
                "loaded step %d from shared memory%s", from_memory[0], self._from_memory_note()
            )
            self.last_load_source = "memory"
            return from_memory
        found = engine.format.load_newest(catalog, target, bound)
        if found is None:
            return None
        log.info(
            "loaded step %d from %s", found[0], catalog.storage.url(catalog.step_dir(found[0]))
        )
        self.last_load_source = "storage"
        return found

    def wait_latest_checkpoint(self, timeout: float = 1800.0) -> bool:
        """Block until the newest DISK save is committed on storage (False at the deadline);
        raises CheckpointStorageError if its persist failed."""
        return all(e.wait_persisted(timeout) for e in self._engines.values())

    def close(self) -> None:
        """Close every engine this checkpointer opened, each after its pending copy."""
        for engine in self._engines.values():
            engine.close()
        self._engines.clear()


def every_rank_holds(ok: bool) -> bool:
    """True when ``ok`` is True on every rank of the default process group (one all-reduce of
    one number; on the current CUDA device for NCCL); just ``ok`` without a process group."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    device = torch.device("cpu")
    if "nccl" in str(dist.get_backend()):
        device = torch.device("cuda", torch.cuda.current_device())
    failed = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    return int(failed.item()) == 0


def resolve_catalog(engine: CheckpointEngine, resume_path: str) -> tuple[Catalog, int | None]:
    """The catalog to load from and an upper bound on the step: a checkpoint directory or one
    of its step directories (``step_<n>``, or as the engine's format names them)."""
    if not resume_path:
        return engine.catalog(), None
    base = os.path.basename(resume_path.rstrip("/"))
    naming = engine.format.naming
    parent = resume_path.rstrip("/")[: -len(base)].rstrip("/") or "."
    if naming.tagged:  # a tag's step is recorded beside it
        catalog = Catalog(storage_for(parent), engine.keep_last, naming)
        step = catalog.step_named(base)
    else:
        step = naming.parse_dir(base)
    if step is not None:
        return Catalog(storage_for(parent), engine.keep_last, naming), step
    return engine.catalog(resume_path), None


def storage_step(catalog: Catalog) -> int | None:
    """Storage's latest committed step, or None (with a warning) when it cannot be read."""
    try:
        return catalog.latest_step()
    except OSError as exc:
        log.warning("cannot read the latest step of %s: %s", catalog.storage.root, exc)
        return None
