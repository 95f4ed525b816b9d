"""Socket servers with a thread per connection and a cap on the connections served at once."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import socketserver
import threading
from typing import Any

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 128
"""Connections the kernel queues before the server accepts them. A unix socket refuses a
connection at once (EAGAIN) when its queue is full, so the socketserver default of 5 made a
node's ranks connecting together fail to reach their saver."""


class BoundedThreadingMixIn(socketserver.ThreadingMixIn):
    """Serves each connection on a thread of its own, at most ``max_connections`` at once:
    connections that open and then send nothing (or never close) cannot grow the server's
    threads without end. A connection beyond the cap gets one JSON line ``{"ok": false,
    "error": ...}`` (the refusal both socket protocols read) and is closed."""

    daemon_threads = True
    request_queue_size = LISTEN_BACKLOG
    max_connections = 64
    """Set by the subclass: connections served at once."""
    what = "server"
    """What the refusal calls the server."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Start the connection's thread, or refuse it when every slot is taken."""
        if not self._slots.acquire(blocking=False):
            log.warning(
                "%s refused a connection: %d connections are being served (the most at once)",
                self.what,
                self.max_connections,
            )
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()  # the thread did not start
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """Serve the connection, then free its slot."""
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request: socket.socket) -> None:
        error = (
            f"the {self.what} already serves {self.max_connections} connections, the most it "
            "serves at once: try again shortly"
        )
        with contextlib.suppress(OSError):
            request.settimeout(1.0)  # the refusal must not block the accepting thread
            request.sendall(json.dumps({"ok": False, "error": error}).encode() + b"\n")
        self.shutdown_request(request)  # type: ignore[attr-defined]
