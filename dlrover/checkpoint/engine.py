"""The worker side of flash checkpointing: copy state into the agent's segment, load it back."""

from __future__ import annotations

import atexit
import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from dlrover import worker_context
from dlrover.checkpoint.catalog import Catalog
from dlrover.checkpoint.client import SaverClient
from dlrover.checkpoint.config import (
    DEFAULT_COPY_WAIT_S,
    DEFAULT_KEEP_LAST,
    ENV_BUFFERS,
    ENV_CHECKPOINT_SOCKET,
    CheckpointEnv,
)
from dlrover.checkpoint.errors import CheckpointError, CheckpointStorageError, SegmentStateError
from dlrover.checkpoint.formats import CheckpointFormat, format_named
from dlrover.checkpoint.layout import Layout, plan_layout, read_state, write_state
from dlrover.checkpoint.leftovers import owner_prefix, runtime_dir
from dlrover.checkpoint.peer_load import load_from_peer
from dlrover.checkpoint.saver import CheckpointSaver
from dlrover.checkpoint.saver_messages import (
    AttachRequest,
    BeginCopyRequest,
    CopiedRequest,
    LoadStepRequest,
    PersistSpec,
    WaitPersistedRequest,
)
from dlrover.checkpoint.shm import SharedSegment
from dlrover.checkpoint.storage import storage_for
from dlrover.constants import ENV_JOB_NAME, ENV_LOCAL_INDEX, ENV_RDZV_ROUND
from dlrover.worker_context import WorkerContext

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerPlacement:
    """Where this process sits in the job, read from the torchrun environment."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    round_id: int

    @classmethod
    def from_env(cls) -> WorkerPlacement:
        """This process's place from its worker environment (see dlrover.worker_context)."""
        ctx = WorkerContext.from_env()
        index = os.environ.get(ENV_LOCAL_INDEX, "")
        return cls(
            ctx.rank,
            # A node that goes on without a failed local rank numbers its workers without it:
            # the first of them copies a replicated state (see dlrover.trainer.torch.inprocess).
            int(index) if index.isdigit() else ctx.local_rank,
            ctx.world_size,
            ctx.local_world_size,
            ctx.node_rank,
            # Every (re)start of workers under dlrover-run follows a rendezvous round of its
            # own, the same on every node; restart counts differ between nodes (one restarted
            # after a failure, another only re-formed), so they must not be part of it.
            # Without a round (plain torchrun), the restart count stands in.
            ctx.rdzv_round if ctx.rdzv_round > 0 else ctx.restart_count,
        )

    @property
    def num_nodes(self) -> int:
        """Nodes in the world (world size / local world size)."""
        return max(1, self.world_size // max(1, self.local_world_size))


def _place_key() -> tuple[str | None, ...]:
    """The variables a `WorkerPlacement` is read from that change between rounds."""
    env = os.environ
    return (
        env.get(worker_context.RANK),
        env.get(worker_context.WORLD_SIZE),
        env.get(worker_context.GROUP_RANK),
        env.get(ENV_LOCAL_INDEX),
        env.get(ENV_RDZV_ROUND),
        env.get(worker_context.RESTART_COUNT),
    )


class CheckpointEngine:
    """Save/load of one process's part of a checkpoint through a CheckpointSaver.

    ``fmt`` (a name of ``dlrover.checkpoint.formats.FORMATS``, or a format) selects who saves
    and how a step is stored: "dcp", every rank its own part (FSDP); "plain", only local rank 0
    of each node copies into memory and only global rank 0 persists (DDP: identical replicas,
    so one copy per node lets every node load from memory while storage gets one copy).

    Without the agent's socket (plain torchrun/python) an in-process saver is started: saves
    and persists work, but memory does not outlive this process, so crash survival and loading
    from memory after a restart need dlrover-run.

    ``replica_count`` (>= 1) keeps the checkpoint in peer nodes' memory too, so a node that
    lost its own (a replaced machine) restores from a peer instead of from storage: sharded
    parts are pushed to the next ``replica_count`` nodes after each copy; replicated (DDP) state
    needs no push, any peer's own copy serves.
    """

    def __init__(
        self,
        checkpoint_dir: str,
        fmt: str | CheckpointFormat,
        keep_last: int = DEFAULT_KEEP_LAST,
        placement: WorkerPlacement | None = None,
        replica_count: int = 0,
    ) -> None:
        if replica_count < 0:
            raise ValueError(f"replica_count must be >= 0, got {replica_count}")
        self.checkpoint_dir = checkpoint_dir
        self.format = format_named(fmt) if isinstance(fmt, str) else fmt
        self.keep_last = keep_last
        self.replica_count = replica_count
        self._given_place = placement
        self._env_place = (_place_key(), WorkerPlacement.from_env()) if placement is None else None
        self.storage = storage_for(checkpoint_dir)
        self.storage.makedirs("")  # fail now, with a clear error, if the dir is unwritable
        if WorkerContext.from_env().restart_count == 0:
            # A restarted rank's first attempt proved the directory writable and its load
            # writes nothing: the probe (a file written and removed, slow on remote storage)
            # stays off the restart's path.
            self._check_writable()
        self._own_saver: CheckpointSaver | None = None
        socket_path = os.environ.get(ENV_CHECKPOINT_SOCKET)
        if not socket_path:
            socket_path = self._start_own_saver()
        self.client = SaverClient(socket_path)
        self._segments: dict[str, SharedSegment] = {}  # path -> this slot's buffers, mapped
        self._last_disk_step: int | None = None
        self._lock = threading.Lock()
        self._pending: threading.Event | None = None
        self._copy_error: BaseException | None = None
        self._hook: RemovableHandle | None = None
        self.last_copy_wait_s = 0.0
        """How long the last save waited for a free buffer (0.0 unless a DISK save found the
        previous persist still running, or DLROVER_CKPT_BUFFERS=1)."""
        self.restored_from_peer: int | None = None
        """After ``memory_step``: the peer node whose memory this node's step was copied from
        (this node had lost its own), else None."""

    # ------------------------------------------------------------------ roles
    @property
    def place(self) -> WorkerPlacement:
        """Where this process sits: the placement given, else the environment's, read again
        when it changed (a process that recovered in-process joined a new round)."""
        if self._given_place is not None:
            return self._given_place
        assert self._env_place is not None
        key = _place_key()
        if key != self._env_place[0]:
            self._env_place = (key, WorkerPlacement.from_env())
        return self._env_place[1]

    @property
    def saves_to_memory(self) -> bool:
        """Whether this rank copies into shared memory: every rank when sharded, else local rank 0."""
        return self.format.saves_to_memory(self.place)

    @property
    def slot(self) -> int:
        """The saver slot this rank writes: its local rank when sharded, else 0."""
        return self.format.slot(self.place)

    @property
    def _persists(self) -> bool:
        """Whether this rank's saves ask for a persist (the format says which ranks do)."""
        return self.format.persists(self.place)

    def _spec(self) -> PersistSpec:
        return PersistSpec(
            checkpoint_dir=self.checkpoint_dir,
            slots=self.format.saving_slots(self.place),
            fmt=self.format.name,  # type: ignore[arg-type]  # a name of FORMATS
            node_rank=self.place.node_rank,
            persist_nodes=self.format.persist_nodes(self.place),
            keep_last=self.keep_last,
            persists=self._persists,
            replicas=self.format.replicas(self.replica_count),
            num_nodes=self.place.num_nodes,
            round_id=self.place.round_id,
        )

    # ------------------------------------------------------------------ saving
    def save(
        self,
        step: int,
        state: Any,
        persist: bool,
        after_tensor: Callable[[int], None] | None = None,
        layout: Layout | None = None,
    ) -> bool:
        """Copy ``state`` into shared memory as ``step``; ask for a persist if ``persist``.

        Always returns True: the copy goes into a buffer of the slot that no persist or push
        reads (with the default two buffers a memory-only save never waits; a DISK save waits
        for the previous persist of the slot). A save that cannot happen raises: ShmSpaceError
        (/dev/shm too small for the buffers), SaverError (no buffer freed in time, the saver
        gone), each naming the cause and what to do.
        """
        if not self.saves_to_memory:
            return True
        self.wait_copy()
        layout = layout or self.plan(state)
        with self._lock:
            seg = self._begin_copy(step, layout, persist)
            write_state(seg, layout, step, after_tensor)
            do_persist = persist and self._persists
            self.client.request(CopiedRequest(self.slot, step, self._spec(), persist=do_persist))
            if persist:
                self._last_disk_step = step
        return True

    def save_overlapped(
        self,
        step: int,
        state: Any,
        persist: bool,
        after_tensor: Callable[[int], None] | None = None,
    ) -> bool:
        """Start copying ``state`` into shared memory in a background thread and return True
        (errors as ``save``; those of the copy itself are raised by ``wait_copy``).

        The copy overlaps the next forward/backward. An optimizer pre-step hook (registered
        once, for every optimizer) waits for it before any parameter or optimizer state
        changes, so the saved step is consistent without the caller's help. Tensors changed
        in place outside ``optimizer.step`` (e.g. BatchNorm running stats in forward) may
        already hold the next step's values: call ``wait_copy`` before such a forward, or
        use the blocking ``save``.
        """
        if not self.saves_to_memory:
            return True
        self.wait_copy()
        layout = self.plan(state)
        with self._lock:
            seg = self._begin_copy(step, layout, persist)
            if self._hook is None:
                self._hook = register_optimizer_step_pre_hook(self._before_optimizer_step)
            done = threading.Event()
            self._pending = done
            threading.Thread(
                target=self._copy_job,
                args=(seg, layout, step, persist, done, after_tensor),
                name=f"ckpt-copy-{step}",
                daemon=True,
            ).start()
        return True

    def _copy_job(
        self,
        seg: SharedSegment,
        layout: Layout,
        step: int,
        persist: bool,
        done: threading.Event,
        after_tensor: Callable[[int], None] | None,
    ) -> None:
        try:
            write_state(seg, layout, step, after_tensor)
            do_persist = persist and self._persists
            self.client.request(CopiedRequest(self.slot, step, self._spec(), persist=do_persist))
            if persist:
                self._last_disk_step = step
        except BaseException as exc:  # surfaced to the trainer by wait_copy
            self._copy_error = exc
        finally:
            done.set()

    def _before_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.wait_copy()

    def wait_copy(self, timeout: float = DEFAULT_COPY_WAIT_S) -> None:
        """Wait for an overlapped copy to finish; re-raise its error if it failed."""
        pending = self._pending
        if pending is None:
            return
        if not pending.wait(timeout):
            raise CheckpointError(
                f"the overlapped copy into shared memory did not finish within {timeout} s"
            )
        self._pending = None
        error, self._copy_error = self._copy_error, None
        if error is not None:
            raise CheckpointError(f"the overlapped checkpoint copy failed: {error}") from error

    def plan(self, state: Any) -> Layout:
        """The shared-memory layout of ``state`` (tensors' offsets and the metadata) for this rank."""
        return plan_layout(
            state,
            {
                "dir": self.checkpoint_dir,
                "rank": self.place.rank,
                "world_size": self.place.world_size,
                # Any node may load this copy (a replicated state: no rank to match), so a
                # replaced node's saver may copy it in before its ranks ask (prepare_round).
                "replicated": not self.format.ranks_to_match(self.place),
            },
        )

    def _begin_copy(self, step: int, layout: Layout, persist: bool) -> SharedSegment:
        """The buffer the saver picked for ``step`` (see ``BeginCopyRequest``), mapped here."""
        reply = self.client.request(
            BeginCopyRequest(
                self.slot,
                nbytes=layout.required_bytes(step),
                step=step,
                persist=persist,
                timeout=DEFAULT_COPY_WAIT_S,
            )
        )
        self.last_copy_wait_s = reply.waited_s
        if reply.waited_s >= 1.0:
            log.warning(
                "the save of step %d waited %.1f s for the previous persist or peer push of "
                "its buffer (a DISK save waits for the one before; with %s=1 every save does)",
                step,
                reply.waited_s,
                ENV_BUFFERS,
            )
        return self._attach(reply.path)

    def _attach(self, path: str) -> SharedSegment:
        """``path`` mapped in this process (once per buffer), remapped if the saver grew it."""
        seg = self._segments.get(path)
        if seg is None:
            seg = self._segments[path] = SharedSegment.attach(path)
        else:
            seg.remap()
        return seg

    def wait_persisted(self, timeout: float) -> bool:
        """Wait until the last DISK save is committed on storage; raise if its persist failed."""
        self.wait_copy()
        step = self._last_disk_step
        if step is None:
            return True
        reply = self.client.request(WaitPersistedRequest(self.checkpoint_dir, step, timeout))
        if reply.failure:
            raise CheckpointStorageError(
                f"persisting to {self.checkpoint_dir} failed: "
                f"{reply.failure}; the step is still in memory"
            )
        return reply.persisted

    # ------------------------------------------------------------------ loading
    def memory_step(self, storage_step: int | None) -> int | None:
        """The step every rank agrees to load from memory, if not older than storage's."""
        if self._own_saver is not None:
            return None  # in-process memory does not survive a restart
        # The format says which slots hold this node's state and what a copy must match to
        # load (sharded: the same rank's part at the same world size as now).
        reply = self.client.request(
            LoadStepRequest(
                slots=list(self.format.saving_slots(self.place)),
                node_rank=self.place.node_rank,
                total_nodes=self.place.num_nodes,
                round_id=self.place.round_id,
                ranks=self.format.ranks_to_match(self.place),
                world_size=self.format.world_size_to_match(self.place),
                timeout=60.0,
                replica_count=self.replica_count,
                checkpoint_dir=self.checkpoint_dir,
                fmt=self.format.name,
            )
        )
        step = reply.step
        self.restored_from_peer = reply.peer
        if step is None or (storage_step is not None and step < storage_step):
            return None
        return step

    def load_from_memory(
        self, target: Any = None, step: int | None = None
    ) -> tuple[int, Any, dict[str, Any]]:
        """(step, state, metadata) from the buffer of this process's slot holding ``step``
        (None: the newest complete one), or from the peer's memory the vote found it in;
        SegmentStateError if none holds it or the copy from the peer failed (``target`` may
        then hold part of it: load it from storage)."""
        # A rank that alone reads its slot takes a step held only by a peer straight into its
        # tensors; where several ranks read one slot (DDP), the saver copies it in once.
        direct = self.format.reads_directly(self.place)
        reply = self.client.request(AttachRequest(self.slot, step, direct=direct))
        if reply.path is None and reply.peer_addr and reply.step is not None:
            got, state, meta = load_from_peer(
                reply.peer_addr, reply.token, reply.key, reply.step, target
            )
        elif reply.path is None:
            held = "no segment" if step is None else f"no complete copy of step {step}"
            raise SegmentStateError(f"the saver holds {held} for this rank")
        else:
            try:
                segment = self._attach(reply.path)
            except CheckpointError as exc:  # gone since the saver counted it: not loadable
                raise SegmentStateError(str(exc)) from exc
            got, state, meta = read_state(segment, target)
        if step is not None and got != step:
            raise SegmentStateError(f"memory moved on from step {step} to {got} while loading")
        step = got
        if meta.get("dir") != self.checkpoint_dir:
            raise SegmentStateError(f"memory holds a checkpoint of {meta.get('dir')!r}")
        return step, state, meta

    def catalog(self, resume_path: str = "") -> Catalog:
        """The checkpoints committed to storage (or to ``resume_path``), to list or load from."""
        storage = storage_for(resume_path) if resume_path else self.storage
        return Catalog(storage, self.keep_last, self.format.naming)

    # ------------------------------------------------------------------ lifecycle
    def _check_writable(self) -> None:
        probe = f".probe-{uuid.uuid4().hex[:8]}"
        try:
            self.storage.write_atomic(probe, b"")
            self.storage.remove(probe)
        except (CheckpointError, OSError) as exc:
            raise CheckpointStorageError(
                f"checkpoint_dir {self.checkpoint_dir!r} is not writable: {exc}"
            ) from exc

    def _start_own_saver(self) -> str:
        log.warning(
            "%s is not set (not launched by dlrover-run): persisting from an in-process"
            " saver; checkpoints in memory will not survive a process crash",
            ENV_CHECKPOINT_SOCKET,
        )
        # Named like an agent's (job, node = this rank, pid), so a sweep can tell the owner.
        prefix = owner_prefix(
            os.environ.get(ENV_JOB_NAME, "local"), f"rank{self.place.rank}", os.getpid()
        )
        prefix = f"{prefix}.{uuid.uuid4().hex[:8]}"
        path = os.path.join(runtime_dir(), f"{prefix}.sock")
        settings = CheckpointEnv.from_env()
        saver = CheckpointSaver(
            path,
            shm_prefix=f"{prefix}.ckpt",
            buffers=settings.buffers,
            shm_dir=settings.shm_dir,
            spill_dir=settings.spill_dir,
        )
        saver.start()
        self._own_saver = saver
        atexit.register(self.close)
        return path

    def close(self) -> None:
        """Close the connection; an in-process saver first finishes its pending persist."""
        try:
            self.wait_copy()
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
        for seg in self._segments.values():
            seg.close()
        self._segments.clear()
        if self._own_saver is not None:
            try:
                self.wait_persisted(60.0)
            except CheckpointError as exc:
                log.error("%s", exc)
            self.client.close()
            self._own_saver.close(unlink=True)
            self._own_saver = None
        else:
            self.client.close()
