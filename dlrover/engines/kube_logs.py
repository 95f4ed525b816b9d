"""Node logs of Kubernetes pods, read through the API: the pod's log is its agent's console, where
the agent also echoes each worker's lines as ``[rank R] line`` (`dlrover.agent.rank_echo`)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

from dlrover.engines.node_logs import LogChunk

log = logging.getLogger(__name__)

RANK_LOG_DIR_IN_POD = "/tmp/dlrover-ranks"
"""Where a pod's agent writes its workers' per-rank files (inside the container)."""
SCAN_LINES = 20000
"""How many of a pod log's last lines a tail or a rank listing reads."""
REQUEST_TIMEOUT_S = 10
_TAG = re.compile(r"^\[rank (\d+)\] ")


def split_console(text: str, rank: int | None) -> list[str]:
    """The lines of ``rank`` (their tag removed) in a node's console, or with ``rank`` None the
    node's own lines (the untagged ones)."""
    lines = []
    for line in text.splitlines():
        match = _TAG.match(line)
        if rank is None and match is None:
            lines.append(line)
        elif rank is not None and match is not None and int(match.group(1)) == rank:
            lines.append(line[match.end() :])
    return lines


class KubeNodeLogs:
    """`NodeLogs` of a job's pods (their container logs, split by rank tag). A follower's reads
    fetch the whole log each time: the API offers no byte offsets."""

    def __init__(
        self, core: Any, namespace: str, node_ids: Callable[[], tuple[str, ...]] = tuple
    ) -> None:
        """``node_ids``: the pods the engine knows now."""
        self._core = core
        self._namespace = namespace
        self._node_ids = node_ids

    def node_ids(self) -> tuple[str, ...]:
        """See `NodeLogs.node_ids`."""
        return self._node_ids()

    def _text(self, pod: str, tail_lines: int | None) -> str | None:
        try:
            response = self._core.read_namespaced_pod_log(
                pod,
                self._namespace,
                tail_lines=tail_lines,
                _preload_content=False,  # raw text: no JSON decoding of a log line
                _request_timeout=REQUEST_TIMEOUT_S,
            )
        except Exception as error:  # ApiException 404/400 (no such pod, not started): no log
            log.info("pod %s: cannot read its log: %s", pod, getattr(error, "reason", error))
            return None
        return bytes(response.data).decode(errors="replace")

    def tail(self, node_id: str, rank: int | None, lines: int) -> str | None:
        """See `NodeLogs.tail`."""
        text = self._text(node_id, SCAN_LINES)
        if text is None:
            return None
        got = split_console(text, rank)
        if rank is not None and not got:
            return None
        return "\n".join(got[-lines:])

    def ranks(self, node_id: str) -> tuple[int, ...]:
        """See `NodeLogs.ranks`."""
        text = self._text(node_id, SCAN_LINES) or ""
        return tuple(sorted({int(m.group(1)) for m in map(_TAG.match, text.splitlines()) if m}))

    def read(self, node_id: str, rank: int | None, stream: str, offset: int) -> LogChunk | None:
        """See `NodeLogs.read`; a pod's log merges stdout and stderr: it is all ``stdout``."""
        source = f"pod {self._namespace}/{node_id}"
        if stream != "stdout":
            return LogChunk("", 0, source)
        text = self._text(node_id, None)
        if text is None:
            return None
        lines = split_console(text, rank)
        data = "".join(line + "\n" for line in lines).encode()
        if offset < 0 or offset > len(data):
            offset = len(data) if offset < 0 else 0
        return LogChunk(data[offset:].decode(errors="replace"), len(data), source)
