"""Reading node logs back: an agent's own log and its workers' per-rank logs, for the dashboard
and `dlrover logs` (local files here; the Ray actor runs the same reads on its machine)."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Protocol

TAIL_BYTES = 256 << 10
"""How far back from a log's end a tail reads (a tail of a few thousand lines fits)."""
RANK_STREAMS = ("stdout.log", "stderr.log")
"""The files of one rank's attempt, as the agent writes them with --redirects 3."""
STREAMS = ("stdout", "stderr")
"""What a log read names: a process's standard output or error."""
READ_LIMIT = 1 << 20
"""The most bytes one `NodeLogs.read` returns (a follower reads again for the rest)."""
_ATTEMPT = re.compile(r"attempt_(\d+)$")
_RANK = re.compile(r"rank_(\d+)$")


@dataclasses.dataclass(frozen=True)
class LogChunk:
    """What a `NodeLogs.read` got: text from one stream, where the next read starts, and which
    file it came from (it changes when a new attempt of the rank starts: then read from 0)."""

    text: str
    offset: int
    source: str


class NodeLogs(Protocol):
    """Where a job's node logs can be read: an engine's, or the job directory's (local)."""

    def tail(self, node_id: str, rank: int | None, lines: int) -> str | None:
        """The last ``lines`` lines of node ``node_id``'s own log (``rank`` None), or of its
        worker ``rank``'s latest attempt (each: stdout, then stderr); None where there is none."""
        ...

    def ranks(self, node_id: str) -> tuple[int, ...]:
        """The global ranks node ``node_id`` has logs of, lowest first (() for an unknown node)."""
        ...

    def node_ids(self) -> tuple[str, ...]:
        """Every node whose logs can be read here (also nodes the master's table does not list:
        a TensorFlow job's ps, chief and workers)."""
        ...

    def read(self, node_id: str, rank: int | None, stream: str, offset: int) -> LogChunk | None:
        """``stream`` (stdout or stderr) of the node's own log or of worker ``rank``'s latest
        attempt from byte ``offset`` on (-1: its end), at most READ_LIMIT bytes; None where
        there is none."""
        ...


def tail_file(path: Path, lines: int) -> str:
    """The last ``lines`` lines of ``path`` (at most TAIL_BYTES back; "" when it is missing)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def latest_rank_dirs(root: Path) -> dict[int, Path]:
    """The ranks of the latest attempt under a per-rank log root
    (``<root>/<run_id>/attempt_<n>/rank_<r>``) -> their directories. Earlier attempts' ranks
    are left out: after a new round a rank may live on another node."""
    latest: tuple[int, float, Path] | None = None
    if not root.is_dir():
        return {}
    for run in root.iterdir():
        if not run.is_dir():
            continue
        for attempt_dir in run.iterdir():
            attempt = _ATTEMPT.match(attempt_dir.name)
            if attempt is None or not attempt_dir.is_dir():
                continue
            key = (int(attempt.group(1)), attempt_dir.stat().st_mtime, attempt_dir)
            if latest is None or key[:2] > latest[:2]:
                latest = key
    if latest is None:
        return {}
    found = {}
    for rank_dir in latest[2].iterdir():
        rank = _RANK.match(rank_dir.name)
        if rank is not None:
            found[int(rank.group(1))] = rank_dir
    return dict(sorted(found.items()))


def read_file(path: Path, offset: int) -> LogChunk:
    """`NodeLogs.read` of one file: whole lines from ``offset`` (-1: the end), at most
    READ_LIMIT bytes (a line still being written waits for the next read)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            if offset < 0 or offset > size:  # -1, or a file that started over
                offset = size if offset < 0 else 0
            f.seek(offset)
            data = f.read(READ_LIMIT)
    except FileNotFoundError:
        return LogChunk("", 0, str(path))
    end = data.rfind(b"\n") + 1 if len(data) < READ_LIMIT else len(data)
    return LogChunk(data[:end].decode(errors="replace"), offset + end, str(path))


def rank_tail(rank_dir: Path, lines: int) -> str:
    """The last ``lines`` lines of a rank's attempt: its stdout, then its stderr if any."""
    parts = [tail_file(rank_dir / name, lines) for name in RANK_STREAMS]
    return "\n".join(p for p in parts if p)


def safe_node_id(node_id: str) -> bool:
    """Whether ``node_id`` can name a directory of its own (no path tricks)."""
    return "/" not in node_id and node_id not in ("", ".", "..")


class LocalNodeLogs:
    """The local engine's logs: ``<nodes>/<node_id>/{stdout,stderr}`` (the agent) and
    ``<nodes>/<node_id>/ranks/...`` (its workers)."""

    def __init__(self, nodes_dir: Path) -> None:
        self.nodes_dir = nodes_dir

    def node_dir(self, node_id: str) -> Path | None:
        """The node's directory, or None for an id that names none."""
        path = self.nodes_dir / node_id
        return path if safe_node_id(node_id) and path.is_dir() else None

    def node_ids(self) -> tuple[str, ...]:
        """Every node that left logs, by name."""
        if not self.nodes_dir.is_dir():
            return ()
        return tuple(sorted(p.name for p in self.nodes_dir.iterdir() if p.is_dir()))

    def rank_dirs(self, node_id: str) -> dict[int, Path]:
        """The node's ranks -> their latest attempt's directory."""
        path = self.node_dir(node_id)
        return latest_rank_dirs(path / RANKS_SUBDIR) if path is not None else {}

    def tail(self, node_id: str, rank: int | None, lines: int) -> str | None:
        """See `NodeLogs.tail`."""
        path = self.node_dir(node_id)
        if path is None:
            return None
        if rank is None:
            if not any((path / s).is_file() for s in STREAMS):
                return None
            parts = [tail_file(path / s, lines) for s in STREAMS]  # stdout, then stderr
            return "\n".join(p for p in parts if p)
        rank_dir = self.rank_dirs(node_id).get(rank)
        return rank_tail(rank_dir, lines) if rank_dir is not None else None

    def ranks(self, node_id: str) -> tuple[int, ...]:
        """See `NodeLogs.ranks`."""
        return tuple(self.rank_dirs(node_id))

    def read(self, node_id: str, rank: int | None, stream: str, offset: int) -> LogChunk | None:
        """See `NodeLogs.read`."""
        if stream not in STREAMS:
            raise ValueError(f"stream {stream!r}: one of {', '.join(STREAMS)}")
        path = self.node_dir(node_id)
        if path is None:
            return None
        if rank is not None:
            rank_dir = self.rank_dirs(node_id).get(rank)
            if rank_dir is None:
                return None
            return read_file(rank_dir / f"{stream}.log", offset)
        return read_file(path / stream, offset)


RANKS_SUBDIR = "ranks"
"""The per-rank log root inside a local node's directory."""
