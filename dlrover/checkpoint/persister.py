"""Persister: writes a step held in a node's shared-memory buffers to storage, in the background."""

from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from collections.abc import Callable

from dlrover.api.errors import MasterUnreachableError
from dlrover.checkpoint.buffers import SlotBuffers
from dlrover.checkpoint.catalog import Catalog, Finalizer
from dlrover.checkpoint.config import DEFAULT_PERSIST_WAIT_S, run_in_background
from dlrover.checkpoint.coordinator import CommitCoordinator
from dlrover.checkpoint.errors import CheckpointError
from dlrover.checkpoint.formats import format_named
from dlrover.checkpoint.saver_messages import PersistSpec, WaitPersistedReply
from dlrover.checkpoint.shm import SharedSegment
from dlrover.checkpoint.storage import Storage, storage_for

log = logging.getLogger(__name__)

FULL_RETRY_S = 1.0
"""How often a wait for a step whose persist found storage full writes it again."""


def _storage_full(exc: BaseException) -> bool:
    """Whether ``exc`` (or what it was raised from) says the storage has no room."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class Persister:
    """The persist half of a ``CheckpointSaver``: one thread that streams each asked-for step
    of every saving slot to storage, reports it and commits it when this node is the last.

    It shares the saver's ``slots`` and their lock ``cond`` (the saver creates and closes the
    buffers; both pin and unpin them only under ``cond``). Invariants: at most one persist runs
    at a time (``lock``); a buffer is pinned (``persisting``) while its bytes are streamed and
    unpinned as soon as they are out, before the commit, which may wait for other nodes.
    ``after_release`` runs (outside the lock) after each unpin, so the saver can send a peer
    push that waited for the persist; ``common_step`` gives the newest step complete in every
    slot of a spec (the saver's view of its buffers).
    """

    def __init__(
        self,
        cond: threading.Condition,
        slots: dict[int, SlotBuffers],
        coordinator: CommitCoordinator,
        storage_factory: Callable[[str], Storage],
        common_step: Callable[[PersistSpec], int | None],
        after_release: Callable[[], None],
    ) -> None:
        self._cond = cond
        self._slots = slots
        self.coordinator = coordinator
        self._storage_factory = storage_factory
        self._common_step = common_step
        self._after_release = after_release
        self.lock = threading.Lock()
        """Held by the persist running now (a persist on failure waits for it)."""
        self.failures = 0
        """Bumped (under ``cond``) when workers die: waits for their copies give up."""
        self.spec: PersistSpec | None = None
        """The newest spec that asked for persists (set by the saver under ``cond``)."""
        self.committed: dict[str, int] = {}
        """Checkpoint directory -> the newest step committed there (under ``cond``)."""
        self.errors: dict[str, str] = {}
        """Checkpoint directory -> why its latest persist failed (under ``cond``)."""
        self.full: dict[str, int] = {}
        """Checkpoint directory -> the step whose persist found storage full (under ``cond``):
        a wait for it writes it again while the wait lasts (the step is still in memory)."""
        self.last_persist_s = 0.0
        """How long the latest successful persist took (0.0: none yet): heartbeats carry it."""
        self._jobs: queue.Queue[tuple[int, PersistSpec] | None] = queue.Queue()

    # ------------------------------------------------------------------ the thread
    def thread(self) -> threading.Thread:
        """The persist thread, not started (the saver starts and joins it)."""
        return threading.Thread(target=self._loop, name="ckpt-saver-persist", daemon=True)

    def submit(self, step: int, spec: PersistSpec) -> None:
        """Persist ``step`` once every slot of ``spec`` holds it (its buffers stay pinned)."""
        self._jobs.put((step, spec))

    def stop(self) -> None:
        """Let the thread end after the job it runs (the saver joins it)."""
        self._jobs.put(None)

    def _loop(self) -> None:
        run_in_background()  # per thread: only the persist yields to the trainers
        while (job := self._jobs.get()) is not None:
            step, spec = job
            try:
                if not self.wait_ready(step, spec, DEFAULT_PERSIST_WAIT_S):
                    continue
                with self.lock:
                    last = self.last_committed(spec)
                    if last is None or step > last:
                        self.persist(step, spec)
            finally:
                self._release(spec, step)

    # ------------------------------------------------------------------ waits and pins
    def wait_ready(
        self, step: int, spec: PersistSpec, timeout: float, what: str = "persisting"
    ) -> bool:
        """Wait until every saving slot of the node holds ``step`` (they copy in parallel)."""
        with self._cond:
            failures = self.failures
            self._cond.wait_for(
                lambda: self.slots_hold(spec, step) is not False or self.failures != failures,
                timeout,
            )
            if self.slots_hold(spec, step) and self.failures == failures:
                return True
        log.warning("not %s step %d: its copy is not complete in every slot", what, step)
        return False

    def slots_hold(self, spec: PersistSpec, step: int) -> bool | None:
        """True: every slot holds ``step``; False: some slot is behind; None: passed it.
        Called under ``cond``."""
        holds = []
        for s in spec.slots:
            buffers = self._slots.get(s)
            if buffers is not None and buffers.holding(step) is not None:
                holds.append(True)
                continue
            newest = buffers.newest_step() if buffers is not None else None
            if newest is not None and newest > step:
                return None
            holds.append(False)
        return all(holds)

    def _release(self, spec: PersistSpec, step: int) -> None:
        """Unpin the buffers of ``step``'s persist, then run ``after_release``."""
        with self._cond:
            for slot in spec.slots:
                buffers = self._slots.get(slot)
                if buffers is None:
                    continue
                for pins in (buffers.persisting, buffers.pending):
                    for i, pinned_step in list(pins.items()):
                        if pinned_step == step:
                            del pins[i]
            self._cond.notify_all()
        self._after_release()

    # ------------------------------------------------------------------ persisting
    def persist_latest_if_newer(self, timeout: float) -> int | None:
        """Persist the newest step complete in every saving slot if storage lacks it (see
        ``CheckpointSaver.persist_latest_if_newer``). Returns the persisted step."""
        with self._cond:
            spec = self.spec
            # Persists still waiting for a rank to finish copying will never see it finish.
            self.failures += 1
            for b in self._slots.values():
                b.pending.clear()
            self._cond.notify_all()
        if spec is None:
            return None
        if not self.lock.acquire(timeout=timeout):
            log.warning("persist on failure skipped: another persist took over %.0f s", timeout)
            return None
        try:
            step = self._common_step(spec)
            last = self.last_committed(spec)
            if step is None or (last is not None and step <= last):
                return None
            log.info("persisting in-memory step %d after a worker failure", step)
            return step if self.persist(step, spec) else None
        finally:
            self.lock.release()

    def last_committed(self, spec: PersistSpec) -> int | None:
        """The newest step committed to ``spec``'s directory (storage asked once)."""
        with self._cond:
            if spec.checkpoint_dir not in self.committed:
                storage = self._storage_factory(spec.checkpoint_dir)
                latest = Catalog(storage, naming=format_named(spec.fmt).naming).latest_step()
                if latest is not None:
                    self.committed[spec.checkpoint_dir] = latest
            return self.committed.get(spec.checkpoint_dir)

    def persist(self, step: int, spec: PersistSpec) -> bool:
        """Write ``step`` of every slot in ``spec``, report it, commit if last. Never raises.
        Called with ``lock`` held."""
        with self._cond:
            if not self.slots_hold(spec, step):
                log.warning("not persisting step %d: a slot no longer holds it", step)
                return False
            for slot in spec.slots:
                buffers = self._slots[slot]
                held = buffers.holding(step)
                assert held is not None  # slots_hold
                buffers.persisting[held] = step
        started = time.monotonic()
        catalog = Catalog(
            self._storage_factory(spec.checkpoint_dir),
            spec.keep_last,
            format_named(spec.fmt).naming,
        )
        try:
            try:
                finalize = self._write_parts(catalog, step, spec)
            finally:
                # The segments are free for the next copy as soon as their bytes are out;
                # the commit below may wait for other nodes.
                self._release(spec, step)
            self._commit(catalog, step, spec, finalize)
        except Exception as exc:  # any failure must leave training running and storage intact
            log.error("persisting step %d to %s failed: %s", step, spec.checkpoint_dir, exc)
            with self._cond:
                self.errors[spec.checkpoint_dir] = f"step {step}: {exc}"
                if _storage_full(exc):
                    self.full[spec.checkpoint_dir] = step
                else:
                    self.full.pop(spec.checkpoint_dir, None)
                self._cond.notify_all()
            return False
        self.last_persist_s = time.monotonic() - started
        log.info(
            "persisted step %d to %s in %.2f s", step, spec.checkpoint_dir, self.last_persist_s
        )
        return True

    def _segments_of(self, spec: PersistSpec, step: int) -> dict[int, SharedSegment]:
        """Slot -> the buffer holding ``step``, for every slot of ``spec``; under the lock."""
        segs = {}
        for slot in spec.slots:
            buffers = self._slots[slot]
            held = buffers.holding(step)
            if held is None:
                raise CheckpointError(f"slot {slot} no longer holds step {step}")
            segs[slot] = buffers.segments[held]
        return segs

    def _write_parts(self, catalog: Catalog, step: int, spec: PersistSpec) -> Finalizer | None:
        """Stream every slot of ``spec`` to storage and record this node's part."""
        with self._cond:
            segs = self._segments_of(spec, step)
        files, extra, finalize = format_named(spec.fmt).write_parts(catalog, step, spec.slots, segs)
        catalog.record_node_part(step, spec.node_rank, files, extra)
        return finalize

    def _commit(
        self, catalog: Catalog, step: int, spec: PersistSpec, finalize: Finalizer | None
    ) -> None:
        """Report this node's part; the last node to report writes manifest and 'latest'."""
        committer = self.coordinator.report_persisted(step, spec.node_rank, spec.persist_nodes)
        if committer:
            catalog.commit(step, spec.fmt, finalize)
            self.coordinator.mark_committed(step)
        elif not self.coordinator.wait_committed(step, DEFAULT_PERSIST_WAIT_S):
            raise CheckpointError(f"step {step} was not committed by every node in time")
        with self._cond:
            self.committed[spec.checkpoint_dir] = step
            self._cond.notify_all()
        if committer:
            # After the waiters are told: deleting older steps is not part of saving this one.
            try:
                catalog.collect_garbage()
            except OSError as exc:
                log.warning("could not delete old steps of %s: %s", spec.checkpoint_dir, exc)

    # ------------------------------------------------------------------ waiting for it
    def _wait_committed_elsewhere(self, checkpoint_dir: str, step: int, timeout: float) -> bool:
        """Whether another node committed ``step`` (or a newer one) within ``timeout``: the
        coordinator says so, or storage's "latest" marker does. Without a master (an
        in-process saver under plain torchrun) nobody tells this node of the writer's commit,
        but the marker, written last and atomically on the storage every node shares, does."""
        catalog = Catalog(storage_for(checkpoint_dir))
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            remaining = deadline - time.monotonic()
            try:
                if self.coordinator.wait_committed(step, min(max(remaining, 0.0), 0.2)):
                    return True
            except MasterUnreachableError:
                # The master is being restarted: each short wait would end in this error (a
                # single wait of the whole timeout used to ride it out); the marker, and the
                # master once back, still count until the deadline.
                pass
            try:
                latest = catalog.latest_step()
            except CheckpointError:
                latest = None  # unreadable now: the coordinator may still say
            if latest is not None and latest >= step:
                return True
            if remaining <= 0:
                return False

    def wait_persisted(self, checkpoint_dir: str, step: int, timeout: float) -> WaitPersistedReply:
        """Wait until ``step`` is committed to ``checkpoint_dir`` (or its persist failed)."""
        with self._cond:
            spec = self.spec
            writes_here = spec is not None and spec.checkpoint_dir == checkpoint_dir
        if not writes_here:
            # This node keeps a memory copy only (DDP: node rank 0 writes storage's one copy):
            # nothing is persisted here, so the step is done when the job's commit says so.
            committed = self._wait_committed_elsewhere(checkpoint_dir, step, timeout)
            with self._cond:
                if committed and self.committed.get(checkpoint_dir, -1) < step:
                    self.committed[checkpoint_dir] = step
                return WaitPersistedReply(
                    persisted=committed, committed=self.committed.get(checkpoint_dir), failure=None
                )
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            with self._cond:
                done = self._cond.wait_for(
                    lambda: (
                        self.committed.get(checkpoint_dir, -1) >= step
                        or checkpoint_dir in self.errors
                    ),
                    max(deadline - time.monotonic(), 0.0),
                )
                error = self.errors.get(checkpoint_dir)
                # A full disk is often a passing state (another job's files, a log burst):
                # while the caller waits, the step, still in memory, is written again.
                again = (
                    error is not None
                    and self.full.get(checkpoint_dir) == step
                    and self.committed.get(checkpoint_dir, -1) < step
                    and deadline - time.monotonic() > FULL_RETRY_S
                )
                if not again:
                    return WaitPersistedReply(
                        persisted=done and error is None,
                        committed=self.committed.get(checkpoint_dir),
                        failure=error,
                    )
                self._cond.wait(FULL_RETRY_S)  # a backoff; a commit meanwhile ends the wait
            if not self._persist_again(checkpoint_dir, step, deadline):
                with self._cond:
                    error = self.errors.get(checkpoint_dir)
                    return WaitPersistedReply(
                        persisted=False, committed=self.committed.get(checkpoint_dir), failure=error
                    )

    def _persist_again(self, checkpoint_dir: str, step: int, deadline: float) -> bool:
        """Write ``step`` to ``checkpoint_dir`` again after storage was full; False when it cannot
        be tried (no longer in memory, another persist held the lock until ``deadline``). Its
        outcome is recorded as any persist's (``committed`` or ``errors``)."""
        if not self.lock.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            return False
        try:
            with self._cond:
                spec = self.spec
                if self.committed.get(checkpoint_dir, -1) >= step:
                    return True
                if spec is None or spec.checkpoint_dir != checkpoint_dir:
                    return False
                if not self.slots_hold(spec, step):
                    return False
                self.errors.pop(checkpoint_dir, None)
            log.info("storage was full: writing step %d to %s again", step, checkpoint_dir)
            if not self.persist(step, spec):
                with self._cond:  # a persist that did not start recorded nothing
                    self.errors.setdefault(checkpoint_dir, f"step {step}: no longer in memory")
            return True
        finally:
            self.lock.release()
