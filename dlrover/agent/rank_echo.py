"""Echo workers' per-rank log files to the agent's stdout as ``[rank R] line``, so that a console
the engine keeps (a Kubernetes pod's log) holds every rank's lines, each tagged."""

from __future__ import annotations

import os
import re
import sys
import threading
from pathlib import Path
from typing import TextIO

RANK_TAG = re.compile(r"^\[rank (\d+)\] ")
"""How an echoed line starts; readers of the console split it by rank with this."""
_RANK_DIR = re.compile(r"rank_(\d+)$")
DEFAULT_POLL_S = 0.2


class RankLogEcho:
    """Follows every ``<root>/<run_id>/attempt_<n>/rank_<r>/{stdout,stderr}.log`` the agent's
    workers write and prints each new whole line, tagged with its rank, to ``out``. `stop` prints
    what is left. A daemon thread polls (files offer nothing to wait on)."""

    def __init__(self, root: str, out: TextIO | None = None, poll_s: float = DEFAULT_POLL_S):
        self._root = Path(root)
        self._out = out or sys.stdout
        self._poll_s = poll_s
        self._offsets: dict[Path, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dlrover-rank-echo", daemon=True)

    def start(self) -> RankLogEcho:
        """Start following; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop following after one last pass (bounded: the thread polls every ``poll_s``)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._poll_s * 10 + 5)

    def _loop(self) -> None:
        while True:
            stopping = self._stop.is_set()
            try:
                self.echo_once()
            except OSError as e:  # a file removed under us: the next pass sees the rest
                print(f"dlrover-run: cannot echo a rank's log: {e}", file=sys.stderr)
            if stopping:
                return
            self._stop.wait(self._poll_s)

    def echo_once(self) -> None:
        """Print every whole line written since the last pass."""
        for path in sorted(self._root.glob("*/attempt_*/rank_*/*.log")):
            match = _RANK_DIR.match(path.parent.name)
            if match is None:
                continue
            offset = self._offsets.get(path, 0)
            if os.path.getsize(path) <= offset:
                continue
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(1 << 20)
            end = data.rfind(b"\n") + 1
            if not end:
                continue  # a line still being written
            self._offsets[path] = offset + end
            tag = f"[rank {match.group(1)}] "
            text = data[:end].decode(errors="replace")
            self._out.write("".join(tag + line + "\n" for line in text.splitlines()))
            self._out.flush()
