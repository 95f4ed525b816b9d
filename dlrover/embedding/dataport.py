"""The hot path's own TCP port: Lookup, Push and Replicate as length-prefixed frames, without
HTTP/2.

Every other call to an embedding server goes over gRPC. Lookup and Push carry 2 MiB of rows
each way per batch of 8192 ids x 64 dims (Replicate twice that, rows and optimizer state), and on loopback gRPC's framing, flow control and
hand-overs between its threads cost about twice what the server's table work costs (a plain
socket moves the same 2 MiB in ~0.4 ms, a gRPC call in ~1.3; docs/embedding.md). So a server
also listens on a plain TCP port (``DataPort`` over gRPC tells which) and takes the same
protobuf messages (frames.py) there:

    request:  method (u8), token length (u16), payload length (u32), token, payload
    reply:    status (u8), payload length (u32), payload

little-endian; every request carries the job token. A reply's status is OK (the payload is
the method's response message: a refusal such as NOT_OWNER travels inside it, as over
gRPC), or TOKEN, MALFORMED, FAILED or BUSY (the server serves as many connections as it
takes) with a UTF-8 explanation; after TOKEN (checked before the payload is read), BUSY and a
header over the limits the server closes the connection. A
connection serves one request at a time; a client keeps one per request it has in flight. Each
side receives into a buffer it keeps per connection and sends its pieces with one ``sendmsg``:
an array goes out straight from where it lies and comes in as a view of that buffer.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from dlrover.checkpoint.bounded_server import BoundedThreadingMixIn
from dlrover.embedding.frames import MalformedMessage
from dlrover.embedding.wire import MAX_MESSAGE_BYTES

logger = logging.getLogger(__name__)

REQUEST = struct.Struct("<BHI")
"""method, token bytes, payload bytes."""
REPLY = struct.Struct("<BI")
"""status, payload bytes."""
LOOKUP, PUSH, REPLICATE = 1, 2, 3
"""The methods (REPLICATE: a server's changed rows to the next one, its replica)."""
OK, TOKEN, MALFORMED, FAILED, BUSY = 0, 1, 2, 3, 4
"""The reply statuses (BUSY: the server serves as many connections as it takes)."""
MAX_TOKEN_BYTES = 4096
IO_TIMEOUT_S = 30.0
"""How long the server gives a request, from its first byte to its last (and a reply to go
out), and a new connection to send its first request."""
IDLE_TIMEOUT_S = 600.0
"""How long the server keeps a connection with nothing to do (its client reconnects once,
at once, when it finds a kept connection closed)."""
CONNECT_TIMEOUT_S = 3.0
REFUSAL_WAIT_S = 1.0
"""How long a client whose request broke off looks for the answer the server sent first."""
POLL_S = 0.05
"""How often the accepting thread looks whether it was told to stop (a server's stop waits
for it)."""

Handler = Callable[[memoryview], list[bytes | memoryview]]
"""A method: the request message's bytes -> the response message's bytes, in pieces sent one
after the other; MalformedMessage when the bytes are no such request."""


class DataPortError(ConnectionError):
    """The connection to a data port failed: ``timed_out`` when the deadline passed."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class DataPortRefused(ValueError):
    """The server answered the request with a status other than OK (the message says why)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


# ----------------------------------------------------------------------------- server
class DataPortServer(BoundedThreadingMixIn, socketserver.TCPServer):
    """Serves ``handlers`` (method -> Handler) on ``host``:``port`` (0: a free one), a thread
    per connection, checking ``token`` on every request."""

    allow_reuse_address = True
    max_connections = 1024
    what = "embedding server's data port"

    def __init__(self, host: str, port: int, token: str, handlers: dict[int, Handler]) -> None:
        host = host.strip("[]")
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.token = token.encode()
        self.handlers = handlers
        self._connections: set[socket.socket] = set()
        self._closing = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        super().__init__((host, port), _Connection)

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self.server_address[1])

    def start(self) -> DataPortServer:
        """Accept connections on a thread of its own."""
        self._thread = threading.Thread(
            target=self.serve_forever,
            args=(POLL_S,),
            name="embedding-data-port",
            daemon=True,
        )
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop accepting and end every connection (their clients see it closed)."""
        if self._thread is not None:
            self.shutdown()
        self.server_close()
        with self._lock:
            self._closing = True
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _refuse(self, request: socket.socket) -> None:
        with contextlib.suppress(OSError):
            request.settimeout(1.0)
            _send(request, _reply(BUSY, f"the {self.what} serves {self.max_connections} "
                                  "connections, the most at once: try again shortly"))  # fmt: skip
        self.shutdown_request(request)

    def track(self, conn: socket.socket, open_: bool) -> bool:
        """Count a connection open or closed (``close`` ends the open ones); False when the
        server is closing (a connection opened just now must end too)."""
        with self._lock:
            (self._connections.add if open_ else self._connections.discard)(conn)
            return not self._closing


class _Connection(socketserver.BaseRequestHandler):
    server: DataPortServer

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _keep_alive(sock)
        if not self.server.track(sock, True):
            self.server.track(sock, False)
            return
        buffer = bytearray()
        served = False
        try:
            while True:
                # A new connection's first request must begin within IO_TIMEOUT_S, a kept
                # one's next within IDLE_TIMEOUT_S (a client gone without a word is found by
                # TCP keep-alive sooner). A request, once begun, has IO_TIMEOUT_S in all.
                sock.settimeout(IDLE_TIMEOUT_S if served else IO_TIMEOUT_S)
                first = sock.recv(1)
                if not first:
                    return
                deadline = time.monotonic() + IO_TIMEOUT_S
                header = first + (_receive(sock, REQUEST.size - 1, deadline=deadline) or b"")
                method, token_len, nbytes = REQUEST.unpack(header)
                if token_len > MAX_TOKEN_BYTES or nbytes > MAX_MESSAGE_BYTES:
                    _send(sock, _reply(MALFORMED, f"a request of {nbytes} bytes with a "
                                       f"{token_len}-byte token is over the limits"), deadline)  # fmt: skip
                    return  # the rest of the stream cannot be trusted
                # The token before the payload: a caller without it is answered and
                # dropped before the server takes in (or makes room for) what it sends.
                token = _receive(sock, token_len, deadline=deadline) or b""
                if not hmac.compare_digest(token, self.server.token):
                    _send(sock, _reply(TOKEN, "wrong or missing job token: set "
                                       "DLROVER_JOB_TOKEN to the job's token"), deadline)  # fmt: skip
                    return
                if len(buffer) < nbytes:
                    buffer = bytearray(nbytes)
                payload = memoryview(buffer)[:nbytes]
                _receive_into(sock, payload, deadline)
                answer = self._answer(method, payload)
                _send(sock, answer, time.monotonic() + IO_TIMEOUT_S)
                served = True
        except (OSError, DataPortError) as e:
            logger.debug("data port connection from %s ended: %s", self.client_address, e)
        finally:
            self.server.track(sock, False)

    def _answer(self, method: int, payload: memoryview) -> list[bytes | memoryview]:
        handler = self.server.handlers.get(method)
        if handler is None:
            return _reply(MALFORMED, f"unknown method {method}")
        try:
            return _reply(OK, *handler(payload))
        except MalformedMessage as e:
            return _reply(MALFORMED, f"malformed request ({len(payload)} bytes): {e}")
        except Exception as e:  # the client gets the reason; the connection goes on
            logger.exception("data port method %d failed", method)
            return _reply(FAILED, f"{type(e).__name__}: {e}")


def _keep_alive(sock: socket.socket) -> None:
    """Probe an idle connection after a minute, and drop it when 3 probes 10 s apart go
    unanswered (where the platform lets us say so)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 60), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _reply(status: int, *payload: bytes | memoryview | str) -> list[bytes | memoryview]:
    parts = [p.encode() if isinstance(p, str) else p for p in payload]
    return [REPLY.pack(status, sum(len(p) for p in parts)), *parts]


# ----------------------------------------------------------------------------- client
class DataChannel:
    """Connections to one server's data port, one per request in flight (thread-safe)."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.host, self.port = host, port
        self._token = token.encode()
        self._free: list[_ClientConnection] = []
        self._lock = threading.Lock()
        self._closed = False

    def connect(self, timeout: float = CONNECT_TIMEOUT_S) -> None:
        """Open one connection now (DataPortError if the port cannot be reached)."""
        conn = _ClientConnection(self.host, self.port, timeout)
        with self._lock:
            self._free.append(conn)

    @contextlib.contextmanager
    def request(
        self, method: int, parts: Sequence[bytes | memoryview], timeout: float
    ) -> Iterator[memoryview]:
        """Send the request message made of ``parts`` and yield the reply's payload: a view of
        the connection's buffer, valid inside the block. DataPortError when the connection
        fails or ``timeout`` passes; DataPortRefused for a status other than OK."""
        deadline = time.monotonic() + timeout
        conn = None
        while conn is None:
            with self._lock:
                conn = self._free.pop() if self._free else None
            if conn is None:
                connect_s = min(max(0.0, deadline - time.monotonic()), CONNECT_TIMEOUT_S)
                conn = _ClientConnection(self.host, self.port, connect_s)
            elif not conn.alive():
                # The server closed this kept connection meanwhile (idle too long): a new one,
                # before anything was sent (a request is never sent twice from here).
                conn.close()
                conn = None
        try:
            status, payload = conn.call(method, self._token, parts, deadline)
        except OSError as e:  # DataPortError among them
            conn.close()
            if isinstance(e, DataPortError):
                raise
            raise DataPortError(str(e)) from None
        try:
            if status != OK:
                raise DataPortRefused(status, bytes(payload).decode(errors="replace"))
            yield payload
        except BaseException:
            conn.close()  # a refusal (the server may close it), or the caller's own error
            raise
        else:
            with self._lock:
                if self._closed:
                    conn.close()
                else:
                    self._free.append(conn)

    def close(self) -> None:
        """Close the idle connections; those in use close when their request ends."""
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
        for conn in free:
            conn.close()


class _ClientConnection:
    def __init__(self, host: str, port: int, timeout: float) -> None:
        try:
            self.sock = socket.create_connection((host, port), timeout=timeout)
        except TimeoutError:
            raise DataPortError(f"connecting to {host}:{port} timed out", timed_out=True) from None
        except OSError as e:
            raise DataPortError(f"cannot connect to {host}:{port}: {e}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = bytearray()

    def call(
        self, method: int, token: bytes, parts: Sequence[bytes | memoryview], deadline: float
    ) -> tuple[int, memoryview]:
        nbytes = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
        header = REQUEST.pack(method, len(token), nbytes)
        try:
            _send(self.sock, [header, token, *parts], deadline)
        except OSError:
            # The server may have answered before reading it all (a wrong token, BUSY, a
            # header over its limits) and closed: that answer says more than the broken pipe.
            deadline = min(deadline, time.monotonic() + REFUSAL_WAIT_S)
            with contextlib.suppress(OSError):
                return self._reply(deadline)
            raise
        return self._reply(deadline)

    def _reply(self, deadline: float) -> tuple[int, memoryview]:
        status, size = REPLY.unpack(_receive(self.sock, REPLY.size, deadline=deadline) or b"")
        if size > MAX_MESSAGE_BYTES:
            raise DataPortError(f"a reply of {size} bytes is over the limit")
        if len(self.buffer) < size:
            self.buffer = bytearray(size)
        payload = memoryview(self.buffer)[:size]
        _receive_into(self.sock, payload, deadline)
        return status, payload

    def alive(self) -> bool:
        """Whether the server has not closed this idle connection (nothing is read)."""
        try:
            self.sock.setblocking(False)
            try:
                return self.sock.recv(1, socket.MSG_PEEK) != b""  # b"": closed by the server
            finally:
                self.sock.setblocking(True)
        except BlockingIOError:
            return True  # open, nothing to read: as an idle connection should be
        except OSError:
            return False

    def close(self) -> None:
        """Close the socket."""
        with contextlib.suppress(OSError):
            self.sock.close()


# ----------------------------------------------------------------------------- both
def _remaining(sock: socket.socket, deadline: float | None) -> None:
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DataPortError("the deadline passed", timed_out=True)
        sock.settimeout(left)


def _send(sock: socket.socket, parts: Sequence[Any], deadline: float | None = None) -> None:
    """Every byte of ``parts`` with as few ``sendmsg`` calls as the kernel allows."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    try:
        while views:
            _remaining(sock, deadline)
            sent = sock.sendmsg(views)
            while views and sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            if views and sent:
                views[0] = views[0][sent:]
    except TimeoutError:
        raise DataPortError("sending timed out", timed_out=True) from None


def _receive(
    sock: socket.socket, nbytes: int, eof_ok: bool = False, deadline: float | None = None
) -> bytes | None:
    """Exactly ``nbytes`` bytes; None at a clean end of the stream before the first when
    ``eof_ok``."""
    data = bytearray(nbytes)
    got = _receive_into(sock, memoryview(data), deadline, eof_ok)
    return None if got is None else bytes(data)


def _receive_into(
    sock: socket.socket, view: memoryview, deadline: float | None = None, eof_ok: bool = False
) -> int | None:
    got = 0
    try:
        while got < view.nbytes:
            _remaining(sock, deadline)
            n = sock.recv_into(view[got:])
            if n == 0:
                if got == 0 and eof_ok:
                    return None
                raise DataPortError(f"the connection closed {got} bytes into {view.nbytes}")
            got += n
    except TimeoutError:
        raise DataPortError("receiving timed out", timed_out=True) from None
    return got
