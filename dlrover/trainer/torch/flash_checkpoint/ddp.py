"""DdpCheckpointer: flash checkpoints of replicated (DDP or single-process) training state."""

from __future__ import annotations

import logging
from typing import Any

from dlrover.trainer.torch.flash_checkpoint.checkpointer import Checkpointer, StorageType

__all__ = ["DdpCheckpointer", "StorageType"]

log = logging.getLogger(__name__)


class DdpCheckpointer(Checkpointer):
    """Saves a state dict that every rank holds identically.

    Local rank 0 of each node copies it into its node's shared memory (so every node can load
    from memory after a restart); only global rank 0 persists it (storage needs one copy).
    Other ranks' ``save_checkpoint`` calls return at once.
    """

    checkpoint_format = "plain"

    def save_checkpoint(
        self,
        step: int,
        state_dict: dict[str, Any],
        path: str = "",
        storage_type: StorageType = StorageType.DISK,
        overlap: bool = False,
    ) -> bool:
        """Copy ``state_dict`` into shared memory; with DISK also persist it in the background.

        ``path`` saves into another checkpoint directory. ``overlap`` returns before the copy
        is done: it runs during the next forward/backward and the next ``optimizer.step``
        waits for it (see CheckpointEngine.save_overlapped for the one caveat). Returns True:
        no save is skipped (a copy made while the previous step is persisted or pushed to a peer
        goes into the slot's other buffer); one that cannot happen raises a CheckpointError that
        names the cause (ShmSpaceError: /dev/shm too small).
        """
        engine = self._engine_for(path)
        persist = storage_type == StorageType.DISK
        if overlap:
            return engine.save_overlapped(step, state_dict, persist)
        return engine.save(step, state_dict, persist)

    def wait_copy(self) -> None:
        """Wait for an overlapped save's copy into shared memory to finish."""
        for engine in self._engines.values():
            engine.wait_copy()

    def load_checkpoint(
        self, resume_path: str = "", target: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The newest state: from memory when every rank holds a step not older than storage's,
        else the newest verified step on storage; {} when there is none.

        ``target`` (e.g. ``{"model": model.state_dict(), ...}``) is filled in place, which
        saves allocating fresh tensors; the returned dict then shares its tensors.
        """
        found = self._load_newest(resume_path, target)
        return {} if found is None else dict(found[1])
