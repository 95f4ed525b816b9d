"""The worker's end of the saver socket: typed messages as JSON lines (``saver_messages.py``)."""

from __future__ import annotations

import socket
import threading

from dlrover.checkpoint.config import DEFAULT_REQUEST_TIMEOUT_S
from dlrover.checkpoint.errors import SaverError, ShmSpaceError
from dlrover.checkpoint.saver_messages import (
    Refused,
    ReplyT,
    SaverRequest,
    ShmSpaceRefused,
    decode_reply,
    encode_request,
)
from dlrover.json_messages import MessageError

MAX_LINE_BYTES = 1 << 20
ANSWER_GRACE_S = 5.0
"""Added to a request's own wait for the saver's answer to travel back."""


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

    def request(self, request: SaverRequest[ReplyT]) -> ReplyT:
        """Send ``request`` and return the saver's reply; raise SaverError on refusal.

        The answer is awaited for the request's own wait (``answer_within_s``) plus a grace,
        or for the client's timeout when the saver answers at once.
        """
        op = request.op
        try:
            line = encode_request(request)
        except MessageError as exc:
            raise SaverError(f"malformed checkpoint saver request: {exc}") from exc
        wait = request.answer_within_s()
        with self._lock:
            self._sock.settimeout(self._timeout if wait is None else wait + ANSWER_GRACE_S)
            try:
                self._sock.sendall(line)
                raw = self._reader.readline(MAX_LINE_BYTES)
            except OSError as exc:
                raise SaverError(f"checkpoint saver request {op!r} failed: {exc}") from exc
        if not raw:
            raise SaverError(f"the checkpoint saver closed the connection during {op!r}")
        try:
            reply = decode_reply(raw, request.reply_type)
        except MessageError as exc:
            raise SaverError(f"malformed answer of the checkpoint saver: {exc}") from exc
        if isinstance(reply, ShmSpaceRefused):
            raise ShmSpaceError(reply.path, reply.needed, reply.free)
        if isinstance(reply, Refused):
            raise SaverError(f"checkpoint saver refused {op!r}: {reply.error}")
        return reply

    def close(self) -> None:
        """Close the socket; the saver keeps serving other workers."""
        self._reader.close()
        self._sock.close()
