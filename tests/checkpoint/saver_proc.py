"""A CheckpointSaver in its own process (like an agent) whose storage can hang on cue.

On a clean exit it prints whether torch was ever imported: the agent must stay torch-free.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from dlrover.checkpoint.saver import CheckpointSaver
from dlrover.checkpoint.storage import LocalStorage, Storage


class HangingStorage(LocalStorage):
    """Writes half of any file of step ``hang_step``, touches ``marker`` and hangs (until the
    parent SIGKILLs the process): a crash in the middle of a persist. ``hang_step`` -1: never."""

    def __init__(self, root: str, hang_step: int, marker: str) -> None:
        super().__init__(root)
        self._prefix = f"step_{hang_step}/"
        self._marker = marker

    @contextlib.contextmanager
    def open_write(self, rel: str) -> Iterator[IO[bytes]]:
        with super().open_write(rel) as f:
            if not rel.startswith(self._prefix):
                yield f
                return

            class Half:
                def write(self, data: bytes | memoryview) -> int:
                    f.write(bytes(data)[: len(data) // 2])
                    f.flush()
                    Path(marker).touch()
                    threading.Event().wait(3600)
                    return 0

            marker = self._marker
            yield Half()  # type: ignore[misc]

    def write_from(self, rel: str, data: memoryview) -> int:
        # The parallel local write bypasses open_write; route this step's file through it.
        if rel.startswith(self._prefix):
            return Storage.write_from(self, rel, data)
        return super().write_from(rel, data)


def main(socket_path: str, prefix: str, hang_step: str, marker: str) -> None:
    saver = CheckpointSaver(
        socket_path,
        shm_prefix=prefix,
        storage_factory=lambda d: HangingStorage(d, int(hang_step), marker),
    )
    saver.start()
    print("ready", flush=True)
    sys.stdin.read()  # until the parent closes stdin or kills us
    held = saver.held_steps()
    saver.close(unlink=True)
    print(json.dumps({"torch_loaded": "torch" in sys.modules, "held": held}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
