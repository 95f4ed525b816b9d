"""Checkpoint replicas in peer nodes' memory: a node that lost its shared memory (a replaced
machine) restores its ranks' state from a peer instead of from storage.

Every agent's saver serves its segments on a TCP port (``ReplicaExchange``): its own slots, and
the replicas other nodes pushed to it. The wire format is a JSON line per request and reply
(``ReplicaRequest`` / ``ReplicaReply``, no pickle) followed by the segment's raw bytes, sent
straight from one mapping and received straight into the other. Peers find each other through
a ``PeerDirectory`` (the job master's KV store in a job).

- Sharded checkpoints (every rank's part differs): after a complete copy, the node pushes its
  slots to the next ``replicas`` nodes of the ring (node rank + 1, + 2, ...), at a bounded rate.
- Replicated checkpoints (DDP: every node holds the same bytes): nothing is pushed; a peer's own
  slot is the replica.

A restoring node lists its peers' segments, picks the newest step that holds every rank it
needs (same ranks, same world size, same checkpoint directory) and votes that step like any
node whose memory survived; nothing is copied before a rank loads. A rank that alone reads its
slot then receives the image straight into its tensors (``read_image``: the metadata first,
then the data, see peer_load.py); a slot several ranks read (DDP) is copied once into the
node's shared memory when the first of them loads (``fetch``).
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from dlrover.checkpoint.bounded_server import BoundedThreadingMixIn
from dlrover.checkpoint.errors import CheckpointError, SegmentStateError
from dlrover.checkpoint.header import (
    HEADER_SIZE,
    begin_write,
    image_len,
    install_header,
    read_header,
    read_metadata,
    read_seq,
)
from dlrover.checkpoint.shm import SharedSegment
from dlrover.json_messages import decode_tagged, encode, from_fields, parse

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20
"""Bytes per send/receive call (and per bandwidth check)."""
IO_TIMEOUT_S = 30.0
"""Deadline of one socket operation between peers."""
REQUEST_TIMEOUT_S = 5.0
"""Deadline of a connection's first line (its request, with the token): a peer asks at once,
and a client that connects and says nothing gives its slot back in 5 s, not 30."""
CONNECT_TIMEOUT_S = 3.0
"""Deadline of a connection to a peer (a dead machine must not stall a restore)."""
DEFAULT_BANDWIDTH_BYTES_S = 1 << 30
"""Default cap on the rate a node pushes replicas at (1 GiB/s): training's traffic goes first."""


MAX_REPLICA_CONNECTIONS = 128
"""Connections a replica server serves at once (peers pushing, listing and reading); more are
refused with an error line rather than each holding a thread."""


class _ReplicaServer(BoundedThreadingMixIn, socketserver.TCPServer):
    max_connections = MAX_REPLICA_CONNECTIONS
    what = "checkpoint replica server"


class ReplicaError(CheckpointError):
    """A peer refused a request, or the transfer broke off; the message says which."""


# ---------------------------------------------------------------------------- directory
class PeerDirectory(Protocol):
    """Where each node's replica server listens, per rendezvous round."""

    def publish(self, round_id: int, node_rank: int, addr: str) -> None:
        """Node ``node_rank`` of round ``round_id`` serves at ``addr`` (``host:port``)."""
        ...

    def lookup(self, round_id: int, node_rank: int, timeout: float) -> str | None:
        """The address node ``node_rank`` published for round ``round_id``, waiting up to
        ``timeout`` seconds for it; None if it did not."""
        ...


class LocalPeerDirectory:
    """A PeerDirectory in one process (tests, and several savers of one machine)."""

    def __init__(self) -> None:
        self._addrs: dict[tuple[int, int], str] = {}
        self._cond = threading.Condition()

    def publish(self, round_id: int, node_rank: int, addr: str) -> None:
        """Record the address and wake lookups waiting for it."""
        with self._cond:
            self._addrs[(round_id, node_rank)] = addr
            self._cond.notify_all()

    def lookup(self, round_id: int, node_rank: int, timeout: float) -> str | None:
        """The address, once published (None after ``timeout`` seconds)."""
        with self._cond:
            self._cond.wait_for(lambda: (round_id, node_rank) in self._addrs, timeout)
            return self._addrs.get((round_id, node_rank))


# ---------------------------------------------------------------------------- wire
@dataclass(frozen=True)
class SegmentInfo:
    """One complete checkpoint image a peer holds."""

    key: str  # "own/<slot>" or "replica/<source node rank>/<slot>"
    step: int
    rank: int
    world_size: int
    checkpoint_dir: str
    nbytes: int  # header + data + metadata
    replicated: bool = False  # any node's ranks may load it (DDP), not one rank's part


@dataclass(frozen=True)
class ReplicaRequest:
    """Base of the requests between peers; ``op`` names it on the wire."""

    op: ClassVar[str]
    token: str


@dataclass(frozen=True)
class ListRequest(ReplicaRequest):
    """Which complete images do you hold?"""

    op: ClassVar[str] = "list"


@dataclass(frozen=True)
class GetRequest(ReplicaRequest):
    """Send image ``key`` (it must still hold ``step``)."""

    op: ClassVar[str] = "get"
    key: str
    step: int


@dataclass(frozen=True)
class ReadRequest(ReplicaRequest):
    """Send image ``key`` (it must still hold ``step``) for a load into tensors: its metadata
    first, then its data bytes, then the trailer."""

    op: ClassVar[str] = "read"
    key: str
    step: int


@dataclass(frozen=True)
class PutRequest(ReplicaRequest):
    """Keep this image of ``slot`` from node ``source_node``: ``nbytes`` raw bytes follow."""

    op: ClassVar[str] = "put"
    source_node: int
    slot: int
    nbytes: int


@dataclass(frozen=True)
class ReplicaReply:
    """An answer: ``ok``, or ``error`` saying why not; ``segments`` for a list, ``nbytes`` of the
    image that follows a get (of the data that follows a read's ``meta_len`` bytes of
    metadata)."""

    ok: bool
    error: str = ""
    segments: list[SegmentInfo] = field(default_factory=list)
    nbytes: int = 0
    meta_len: int = 0


@dataclass(frozen=True)
class Trailer:
    """After an image: ``intact`` if the sender's segment did not change while it was sent."""

    intact: bool


_REQUESTS = {r.op: r for r in (ListRequest, GetRequest, ReadRequest, PutRequest)}


def _send_line(sock: socket.socket, message: Any, **tags: str) -> None:
    sock.sendall(encode(message, **tags))


def _recv_line(stream: Any, what: str) -> dict[str, object]:
    line = stream.readline(1 << 20)
    if not line:
        raise ReplicaError(f"{what}: the peer closed the connection")
    return parse(line, what)


def _send_bytes(
    sock: socket.socket, buf: memoryview, start: int, end: int, rate: float | None
) -> None:
    """Send ``buf[start:end]`` straight from the mapping, at most ``rate`` bytes/s."""
    started = time.monotonic()
    for pos in range(start, end, CHUNK_BYTES):
        sock.sendall(buf[pos : min(pos + CHUNK_BYTES, end)])
        if rate:
            ahead = (pos - start + CHUNK_BYTES) / rate - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)  # the bandwidth cap, not a synchronisation


def _send_image(sock: socket.socket, seg: SharedSegment, nbytes: int, rate: float | None) -> None:
    """Send the first ``nbytes`` of ``seg``, at most ``rate`` bytes/s, then the trailer."""
    seq = read_seq(seg)
    _send_bytes(sock, seg.buffer, 0, nbytes, rate)
    _send_line(sock, Trailer(intact=read_seq(seg) == seq and seq % 2 == 0))


def _recv_image(stream: Any, seg: SharedSegment, nbytes: int) -> bool:
    """Receive an image into ``seg`` (already at least ``nbytes`` long): the data first under an
    odd sequence number, the header last, so a broken transfer leaves a torn (unloadable) segment.
    Returns whether the image is complete and intact."""
    header = stream.read(HEADER_SIZE)
    if len(header) != HEADER_SIZE:
        return False
    writing = begin_write(seg)
    buf = seg.buffer
    got = HEADER_SIZE
    while got < nbytes:
        n = stream.readinto(buf[got : min(got + CHUNK_BYTES, nbytes)])
        if not n:
            return False
        got += n
    trailer = from_fields(Trailer, _recv_line(stream, "replica trailer"), "replica trailer")
    if not trailer.intact:
        return False
    install_header(seg, writing, header)
    return True


# ---------------------------------------------------------------------------- the exchange
SegmentsFn = Callable[[], dict[int, SharedSegment]]


class ReplicaExchange:
    """One node's replica server and client: serves its own slots (``own``) and the replicas it
    keeps for other nodes, pushes its slots to peers, and restores from peers.

    ``shm_prefix`` names the replica segments (``<prefix>-replica-n<node>-slot<slot>``);
    ``token`` must match on every request (the job's token); ``bandwidth`` caps pushes (bytes/s,
    None: no cap).
    """

    def __init__(
        self,
        own: SegmentsFn,
        shm_prefix: str,
        shm_dir: str,
        token: str = "",
        host: str = "127.0.0.1",
        bandwidth: float | None = DEFAULT_BANDWIDTH_BYTES_S,
    ) -> None:
        self._own = own
        self._prefix = shm_prefix
        self._shm_dir = shm_dir
        self._token = token
        self._host = host
        self.bandwidth = bandwidth
        self._lock = threading.Lock()  # guards the replica table and every resize of its segments
        self._replicas: dict[tuple[int, int], SharedSegment] = {}
        self._receiving: set[tuple[int, int]] = set()  # replicas whose image is arriving
        self._reading: dict[str, int] = {}  # key -> connections sending that image now
        self._server: _ReplicaServer | None = None
        self._thread: threading.Thread | None = None
        self.addr = ""
        """``host:port`` once started."""

    # ------------------------------------------------------------------ serving
    def start(self) -> None:
        """Listen on a free port of ``host``."""
        exchange = self

        class Handler(socketserver.StreamRequestHandler):
            timeout = IO_TIMEOUT_S

            def handle(self) -> None:
                exchange._serve(self.connection, self.rfile)

        server = _ReplicaServer((self._host, 0), Handler)
        self._server = server
        self.addr = f"{self._host}:{server.server_address[1]}"
        self._thread = threading.Thread(
            target=server.serve_forever, name="ckpt-replica-server", daemon=True
        )
        self._thread.start()
        log.info("checkpoint replica server listening on %s", self.addr)

    def close(self, unlink: bool = True) -> None:
        """Stop serving; with ``unlink`` free the replicas' shared memory."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self._lock:
            for seg in self._replicas.values():
                seg.close(unlink=unlink)
            self._replicas.clear()

    def _serve(self, sock: socket.socket, stream: Any) -> None:
        try:
            sock.settimeout(REQUEST_TIMEOUT_S)
            doc = _recv_line(stream, "replica request")
            sock.settimeout(IO_TIMEOUT_S)
            request = decode_tagged(doc, "op", _REQUESTS, "replica request")
            if not hmac.compare_digest(request.token, self._token):
                _send_line(sock, ReplicaReply(ok=False, error="wrong token"))
                return
            if isinstance(request, ListRequest):
                _send_line(sock, ReplicaReply(ok=True, segments=self.holdings()))
            elif isinstance(request, GetRequest):
                self._serve_get(sock, request)
            elif isinstance(request, ReadRequest):
                self._serve_read(sock, request)
            elif isinstance(request, PutRequest):
                stored = self._store(sock, stream, request)
                _send_line(sock, ReplicaReply(ok=stored, error="" if stored else "torn image"))
        except (OSError, ValueError, CheckpointError) as exc:
            log.warning("replica request from a peer failed: %s", exc)
            with contextlib.suppress(OSError):
                _send_line(sock, ReplicaReply(ok=False, error=f"{type(exc).__name__}: {exc}"))

    def _segments(self) -> Iterator[tuple[str, SharedSegment]]:
        for slot, seg in self._own().items():
            yield f"own/{slot}", seg
        for (node, slot), seg in self._replicas.items():
            yield f"replica/{node}/{slot}", seg

    def holdings(self) -> list[SegmentInfo]:
        """Every complete image this node holds (its own slots and its replicas)."""
        out = []
        with self._lock:
            for key, seg in self._segments():
                info = _info(key, seg)
                if info is not None:
                    out.append(info)
        return out

    @contextlib.contextmanager
    def _sending(self, key: str) -> Iterator[SharedSegment | None]:
        """The segment of ``key`` (None: none), marked as being sent until the block ends: the
        image goes out without the lock (a slow reader must not stall every list and push of
        this node), and a push meanwhile may overwrite it (the trailer then says torn) but not
        resize it (which would unmap what is being sent)."""
        with self._lock:
            seg = dict(self._segments()).get(key)
            if seg is not None:
                self._reading[key] = self._reading.get(key, 0) + 1
        try:
            yield seg
        finally:
            if seg is not None:
                with self._lock:
                    self._reading[key] -= 1
                    if not self._reading[key]:
                        del self._reading[key]

    def _serve_get(self, sock: socket.socket, request: GetRequest) -> None:
        with self._sending(request.key) as seg:
            info = _info(request.key, seg) if seg is not None else None
            if seg is None or info is None or info.step != request.step:
                _send_line(
                    sock, ReplicaReply(ok=False, error=f"no step {request.step} at {request.key}")
                )
                return
            _send_line(sock, ReplicaReply(ok=True, nbytes=info.nbytes))
            _send_image(sock, seg, info.nbytes, None)

    def _serve_read(self, sock: socket.socket, request: ReadRequest) -> None:
        """The metadata of image ``request.key``, then its data, then whether it stayed intact."""
        with self._sending(request.key) as seg:
            header = _complete_header(seg) if seg is not None else None
            if seg is None or header is None or header[1] != request.step:
                _send_line(
                    sock, ReplicaReply(ok=False, error=f"no step {request.step} at {request.key}")
                )
                return
            seq, _, data_len, meta_offset, meta_len = header
            _send_line(sock, ReplicaReply(ok=True, nbytes=data_len, meta_len=meta_len))
            buf = seg.buffer
            sock.sendall(buf[meta_offset : meta_offset + meta_len])
            _send_bytes(sock, buf, HEADER_SIZE, HEADER_SIZE + data_len, None)
            _send_line(sock, Trailer(intact=read_seq(seg) == seq))

    def _store(self, sock: socket.socket, stream: Any, request: PutRequest) -> bool:
        """Make room for the image (a full /dev/shm is refused before any byte is sent), say
        "ready", receive it."""
        key = (request.source_node, request.slot)
        with self._lock:
            if key in self._receiving:
                raise ReplicaError(
                    f"the replica of slot {request.slot} of node {request.source_node} is being "
                    "received from another connection"
                )
            seg = self._replicas.get(key)
            if seg is None:
                name = f"{self._prefix}-replica-n{request.source_node}-slot{request.slot}"
                seg = SharedSegment.create(name, request.nbytes, self._shm_dir)
                self._replicas[key] = seg
            elif seg.size < request.nbytes:
                if self._reading.get(f"replica/{request.source_node}/{request.slot}"):
                    raise ReplicaError(
                        f"the replica of slot {request.slot} of node {request.source_node} is "
                        "being sent to a reader and cannot grow now: push again"
                    )
                seg.grow(request.nbytes)
            self._receiving.add(key)
        # Received without the lock: a peer that sends slowly (or stops) must not stall every
        # list, read and push of this node. Readers see the segment as torn (an odd sequence
        # number) until its header arrives, last; nothing else writes or resizes it meanwhile.
        try:
            _send_line(sock, ReplicaReply(ok=True))
            return _recv_image(stream, seg, request.nbytes)
        finally:
            with self._lock:
                self._receiving.discard(key)

    # ------------------------------------------------------------------ client side
    def push(self, addr: str, source_node: int, slot: int, seg: SharedSegment) -> bool:
        """Send ``seg``'s complete image to the peer at ``addr`` as the replica of ``slot`` of
        node ``source_node``; True if the peer stored it intact."""
        nbytes = image_len(seg)
        with _connect(addr) as (sock, stream):
            _send_line(sock, PutRequest(self._token, source_node, slot, nbytes), op="put")
            ready = _reply(stream, f"replica push to {addr}")
            if not ready.ok:  # a wrong token, no room in the peer's /dev/shm...
                raise ReplicaError(f"peer {addr} refused the replica: {ready.error}")
            _send_image(sock, seg, nbytes, self.bandwidth)
            reply = _reply(stream, f"replica push to {addr}")
        if not reply.ok:
            log.warning("peer %s did not keep the replica of slot %d: %s", addr, slot, reply.error)
        return reply.ok

    def list_peer(self, addr: str) -> list[SegmentInfo]:
        """The complete images the peer at ``addr`` holds."""
        with _connect(addr) as (sock, stream):
            _send_line(sock, ListRequest(self._token), op="list")
            reply = _reply(stream, f"replica list from {addr}")
        if not reply.ok:
            raise ReplicaError(f"peer {addr} refused to list its replicas: {reply.error}")
        return reply.segments

    def fetch(self, addr: str, info: SegmentInfo, into: SharedSegment) -> bool:
        """Copy image ``info`` from the peer at ``addr`` into ``into`` (grown by the caller to
        ``info.nbytes``); True if it arrived complete and intact."""
        with _connect(addr) as (sock, stream):
            _send_line(sock, GetRequest(self._token, info.key, info.step), op="get")
            reply = _reply(stream, f"replica fetch from {addr}")
            if not reply.ok:
                log.warning("peer %s cannot send %s: %s", addr, info.key, reply.error)
                return False
            return _recv_image(stream, into, reply.nbytes)


class PeerImage:
    """An image a peer sends for a load into tensors (``read_image``): ``meta``, its parsed
    metadata, then ``data_len`` bytes of data received in order (``readinto``, ``skip_to``),
    then the trailer (``intact``). ``position`` is the offset of the next data byte."""

    def __init__(self, stream: Any, meta: dict[str, Any], data_len: int) -> None:
        self._stream = stream
        self.meta = meta
        self.data_len = data_len
        self.position = 0

    def readinto(self, view: memoryview) -> None:
        """Receive the next ``len(view)`` data bytes straight into ``view``."""
        if self.position + len(view) > self.data_len:
            raise ReplicaError(
                f"the image's data ends at {self.data_len} bytes, "
                f"{len(view)} asked at {self.position}"
            )
        got = 0
        while got < len(view):
            n = self._stream.readinto(view[got : got + CHUNK_BYTES])
            if not n:
                raise ReplicaError("the peer closed the connection in the middle of the image")
            got += n
        self.position += got

    def skip_to(self, offset: int) -> None:
        """Discard the data bytes before ``offset`` (the padding between tensors)."""
        if not self.position <= offset <= self.data_len:
            raise ReplicaError(f"cannot skip from byte {self.position} to {offset} of the image")
        while self.position < offset:
            chunk = self._stream.read(min(offset - self.position, CHUNK_BYTES))
            if not chunk:
                raise ReplicaError("the peer closed the connection in the middle of the image")
            self.position += len(chunk)

    def intact(self) -> bool:
        """After the data: whether the peer's image stayed the same while it was sent."""
        self.skip_to(self.data_len)
        line = _recv_line(self._stream, "replica trailer")
        return from_fields(Trailer, line, "replica trailer").intact


@contextlib.contextmanager
def read_image(addr: str, token: str, key: str, step: int) -> Iterator[PeerImage]:
    """Open image ``key`` of the peer at ``addr``, which must still hold ``step``, for a load
    straight into tensors; ReplicaError if the peer refuses or the transfer breaks off."""
    with _connect(addr) as (sock, stream):
        _send_line(sock, ReadRequest(token, key, step), op="read")
        reply = _reply(stream, f"replica read from {addr}")
        if not reply.ok:
            raise ReplicaError(f"peer {addr} cannot send {key}: {reply.error}")
        raw = stream.read(reply.meta_len)
        if len(raw) != reply.meta_len:
            raise ReplicaError(f"peer {addr} closed the connection in the metadata of {key}")
        try:
            meta = json.loads(raw)
        except ValueError as exc:
            raise ReplicaError(f"peer {addr} sent unreadable metadata for {key}: {exc}") from exc
        yield PeerImage(stream, meta, reply.nbytes)


def _complete_header(seg: SharedSegment) -> tuple[int, int, int, int, int] | None:
    """(seq, step, data_len, meta_offset, meta_len) of the complete step in ``seg``, or None."""
    try:
        header = read_header(seg)
    except SegmentStateError:
        return None
    return None if header[0] % 2 else header


def _info(key: str, seg: SharedSegment) -> SegmentInfo | None:
    try:
        _, meta = read_metadata(seg)
    except SegmentStateError:
        return None
    return SegmentInfo(
        key,
        int(meta["step"]),
        int(meta.get("rank", -1)),
        int(meta.get("world_size", -1)),
        str(meta.get("dir", "")),
        image_len(seg),
        bool(meta.get("replicated", False)),
    )


def _reply(stream: Any, what: str) -> ReplicaReply:
    return from_fields(ReplicaReply, _recv_line(stream, what), what)


@contextlib.contextmanager
def _connect(addr: str) -> Iterator[tuple[socket.socket, Any]]:
    host, _, port = addr.rpartition(":")
    try:
        sock = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
    except OSError as exc:
        raise ReplicaError(f"cannot reach the checkpoint peer at {addr}: {exc}") from exc
    sock.settimeout(IO_TIMEOUT_S)
    stream = sock.makefile("rb")
    try:
        yield sock, stream
    except OSError as exc:
        raise ReplicaError(f"transfer with the checkpoint peer at {addr} broke off: {exc}") from exc
    finally:
        stream.close()
        sock.close()
