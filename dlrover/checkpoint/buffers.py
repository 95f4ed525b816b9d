"""Double buffering of one slot's shared memory: where a copy goes, what a persist or load reads."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from dlrover.checkpoint.errors import ShmSpaceError
from dlrover.checkpoint.header import begin_write, complete_step
from dlrover.checkpoint.shm import SharedSegment, shm_free_bytes

log = logging.getLogger(__name__)

DEFAULT_BUFFERS = 2
"""Buffers per slot: a copy never waits for a persist or a push of the previous step."""


def choose_buffer(pinned: Sequence[bool], newest: int | None, persist: bool) -> int | None:
    """The buffer a copy goes into, or None: it must wait until a pin is released.

    ``pinned[i]``: buffer ``i`` is read by a persist or a push (asked for or running);
    ``newest``: the buffer holding the newest complete step (None: none). The rules:

    1. a copy never goes into a pinned buffer (it would change the bytes being read);
    2. a copy that asks for a persist waits while any buffer is pinned, so at most one buffer
       of a slot is pinned at a time and a memory-only copy always finds a free one;
    3. among the free buffers, one that does not hold the newest step, so it stays complete
       while the copy runs (a worker killed mid-copy leaves it loadable); that one only when
       it is the one free buffer (one buffer per slot, or the other is being persisted).
    """
    if persist and any(pinned):
        return None
    free = [i for i, p in enumerate(pinned) if not p]
    if not free:
        return None
    others = [i for i in free if i != newest]
    return others[0] if others else free[0]


class SlotBuffers:
    """The ``count`` segments of one slot (``<name>-buf<i>``) and who reads them.

    Invariants (kept by the saver under its lock): ``latest`` is the buffer the last copy went
    into; a buffer in ``pending``, ``persisting``, ``replicating`` or ``receiving`` is pinned
    and never copied into; the newest complete step is ``latest``'s, or the other buffer's when ``latest``'s
    copy was torn. All buffers are created together at the first allocation (the second one
    is used from the second save on) and grown one at a time, only while free; the one
    exception is a step copied in from a peer, which creates only the buffer it needs (the
    others are created by the first copy that picks one of them, in ``begin``).
    """

    def __init__(self, name: str, count: int, shm_dir: str, spill_dir: str | None = None) -> None:
        if count < 1:
            raise ValueError(f"a slot needs at least one buffer, got {count}")
        self.name = name
        self.count = count
        self.shm_dir = shm_dir
        self.spill_dir = spill_dir
        """Where buffers are created when ``shm_dir`` has no room (None: nowhere, the
        allocation raises ShmSpaceError). Only while the need is at most half of its free
        space: a spill must not fill the node's disk either."""
        self.segments: list[SharedSegment] = []
        self.latest: int | None = None
        self.writing: int | None = None
        """The step the copy into ``latest`` was begun for: until that copy's first byte, the
        buffer still holds an older complete step, which is not the newest."""
        self.pending: dict[int, int] = {}  # buffer -> step whose persist was asked, not done
        self.persisting: dict[int, int] = {}  # buffer -> step streamed to storage right now
        self.replicating: set[int] = set()  # buffers sent to a peer right now
        self.receiving: set[int] = set()  # buffers a peer's step is copied into right now

    # ------------------------------------------------------------------ memory
    def ensure(self, nbytes: int, count: int | None = None) -> None:
        """Create the first ``count`` buffers (default: all; at least ``nbytes`` each) if not
        done yet; grow free ones."""
        want = self.count if count is None else min(count, self.count)
        if len(self.segments) < want:
            created = len(self.segments)
            where = self._room_for((want - created) * nbytes)
            try:
                for i in range(created, want):
                    self.segments.append(SharedSegment.create(f"{self.name}-buf{i}", nbytes, where))
            except BaseException:
                for seg in self.segments[created:]:  # all or nothing: none half-allocated
                    seg.close(unlink=True)
                del self.segments[created:]
                raise
            if created == 0:
                return
        for i, seg in enumerate(self.segments):
            if not self.pinned(i) and seg.size < nbytes:
                seg.grow(nbytes)

    def _room_for(self, need: int) -> str:
        """The folder new buffers of ``need`` bytes in all go to: the shared-memory one, else
        the spill folder (said once per slot); ShmSpaceError (the whole need, not one
        buffer's) where neither has room."""
        free = shm_free_bytes(self.shm_dir)
        if need <= free:
            return self.shm_dir
        if self.spill_dir is not None and need <= shm_free_bytes(self.spill_dir) // 2:
            log.warning(
                "%s has %d bytes free but the checkpoint buffers %s-buf* need %d: they are kept "
                "in %s instead (saves, persists and restores after a worker restart work as "
                "usual; a copy may be slower). Enlarge /dev/shm (`docker run --shm-size`, a "
                "Kubernetes emptyDir with medium Memory) or point DLROVER_CKPT_SHM_DIR at a "
                "larger tmpfs",
                self.shm_dir, free, self.name, need, self.spill_dir,
            )  # fmt: skip
            return self.spill_dir
        raise ShmSpaceError(f"{self.name}-buf*", need, free)

    def pinned(self, i: int) -> bool:
        """Whether buffer ``i`` is read by a persist or a push (asked for or running), or
        written by a copy from a peer."""
        return (
            i in self.pending
            or i in self.persisting
            or i in self.replicating
            or i in self.receiving
        )

    def target(self, persist: bool) -> int | None:
        """The buffer the next copy goes into (``choose_buffer``), or None to wait."""
        return choose_buffer([self.pinned(i) for i in range(self.count)], self.newest(), persist)

    def begin(self, i: int, nbytes: int, step: int) -> SharedSegment:
        """Buffer ``i`` becomes the one written last, at least ``nbytes`` long. A free other
        buffer holding ``step`` or a later one is invalidated: the job went back (resumed from
        an older step), and that abandoned step must not look newer than what follows."""
        if i >= len(self.segments):
            self.ensure(nbytes)  # only one buffer was created (a step copied from a peer)
        seg = self.segments[i]
        if seg.size < nbytes:
            seg.grow(nbytes)
        for j, other in enumerate(self.segments):
            if j != i and not self.pinned(j):
                held = complete_step(other)
                if held is not None and held >= step:
                    begin_write(other)  # odd seq: no longer a complete step
        self.latest = i
        self.writing = step
        return seg

    # ------------------------------------------------------------------ reading
    def steps(self) -> list[int | None]:
        """The complete step of each buffer (None: empty or torn)."""
        return [complete_step(seg) for seg in self.segments]

    def newest(self) -> int | None:
        """The buffer holding the newest complete step by write order, or None."""
        if self.latest is None or not self.segments:
            # Nothing written by this saver yet: the highest complete step (adopted memory).
            adopted = [(s, i) for i, s in enumerate(self.steps()) if s is not None]
            return max(adopted)[1] if adopted else None
        held = complete_step(self.segments[self.latest])
        if held is not None and held == self.writing:
            return self.latest
        # The copy into ``latest`` was torn, or killed before its first byte (the buffer still
        # holds an older step): the newest is another buffer's, else that older step.
        for i in range(len(self.segments)):
            if i != self.latest and complete_step(self.segments[i]) is not None:
                return i
        return self.latest if held is not None else None

    def newest_step(self) -> int | None:
        """The newest complete step (see ``newest``), or None."""
        i = self.newest()
        return None if i is None else complete_step(self.segments[i])

    def holding(self, step: int) -> int | None:
        """The buffer holding ``step`` completely (the newest such by write order), or None."""
        order = [] if self.latest is None else [self.latest]
        order += [i for i in range(len(self.segments)) if i != self.latest]
        for i in order:
            if complete_step(self.segments[i]) == step:
                return i
        return None

    def close(self, unlink: bool) -> None:
        """Unmap every buffer; with ``unlink`` give their memory back to the host."""
        for seg in self.segments:
            seg.close(unlink=unlink)
        self.segments = []
