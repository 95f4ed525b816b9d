"""The worker's end of the saver socket: one JSON object per line each way, no pickle."""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

from dlrover.checkpoint.config import DEFAULT_REQUEST_TIMEOUT_S
from dlrover.checkpoint.errors import SaverError, ShmSpaceError

MAX_LINE_BYTES = 1 << 20


class SaverClient:
    """A persistent connection from one worker process to its CheckpointSaver.

    Requests are serialised by a lock, so a trainer thread and an overlap thread may share it.
    """

    def __init__(self, socket_path: str, timeout: float = DEFAULT_REQUEST_TIMEOUT_S) -> None:
        self.socket_path = socket_path
        self._timeout = timeout
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(socket_path)
        except OSError as exc:
            self._sock.close()
            raise SaverError(
                f"cannot reach the checkpoint saver at {socket_path!r}: {exc}; is "
                "the agent (dlrover-run) still running?"
            ) from exc
        self._reader = self._sock.makefile("rb")

    def request(self, op: str, timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        """Send ``{"op": op, **fields}`` and return the reply; raise SaverError on refusal."""
        line = json.dumps({"op": op, **fields}).encode() + b"\n"
        with self._lock:
            self._sock.settimeout(self._timeout if timeout is None else timeout + 5.0)
            try:
                self._sock.sendall(line)
                raw = self._reader.readline(MAX_LINE_BYTES)
            except OSError as exc:
                raise SaverError(f"checkpoint saver request {op!r} failed: {exc}") from exc
        if not raw:
            raise SaverError(f"the checkpoint saver closed the connection during {op!r}")
        reply: dict[str, Any] = json.loads(raw)
        if not reply.get("ok", False) and "error" in reply:
            if reply.get("kind") == "ShmSpaceError":
                raise ShmSpaceError(reply["path"], reply["needed"], reply["free"])
            raise SaverError(f"checkpoint saver refused {op!r}: {reply['error']}")
        return reply

    def close(self) -> None:
        self._reader.close()
        self._sock.close()
