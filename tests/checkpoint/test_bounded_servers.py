"""The checkpoint saver's socket and the replica port under a crowd of connections (found by
benchmarks/protocol_fuzz.py): a burst of connections all reach the saver, and connections that
open and send nothing take at most the cap of threads; the next gets an error line, and once
they close the server serves as before."""

from __future__ import annotations

import json
import socket
import time
import uuid
from pathlib import Path

import pytest

from dlrover.checkpoint import replica, saver
from dlrover.checkpoint.header import FORMAT_VERSION, HEADER_SIZE, begin_write, publish
from dlrover.checkpoint.replica import ReplicaExchange
from dlrover.checkpoint.saver import CheckpointSaver
from dlrover.checkpoint.shm import SharedSegment

CAP = 4


def _reply(sock: socket.socket) -> dict[str, object]:
    sock.settimeout(10)
    with sock.makefile("rb") as reader:
        doc = json.loads(reader.readline())
    assert isinstance(doc, dict)
    return doc


def _unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    return sock


def test_connections_queue_while_the_saver_accepts_none(tmp_path: Path) -> None:
    """The unix socket's listen queue was 5: with the saver busy for a moment, the sixth rank
    connecting got EAGAIN at once ("cannot reach the checkpoint saver")."""
    s = CheckpointSaver(str(tmp_path / "s.sock"), shm_prefix=f"dlrtest-{uuid.uuid4().hex[:8]}")
    s.start()
    assert s._server is not None
    s._server.shutdown()  # accepts nothing from now on; the socket still listens
    connected: list[socket.socket] = []
    try:
        for _ in range(64):
            connected.append(_unix(s.socket_path))
    finally:
        for sock in connected:
            sock.close()
        s.close(unlink=True)


def _crowd(connect: object, probe: bytes) -> None:
    """CAP stalled connections, then one more (refused with an error line), then, once they
    are gone, a request answered as usual."""
    stalled = [connect() for _ in range(CAP)]  # type: ignore[operator]
    try:
        for sock in stalled:
            sock.sendall(b'{"op": "he')  # and nothing more
        with connect() as extra:  # type: ignore[operator]
            refusal = _reply(extra)
        assert refusal["ok"] is False
        assert f"already serves {CAP} connections" in str(refusal["error"])
    finally:
        for sock in stalled:
            sock.close()
    # Each slot frees once its thread has read the end of its connection and answered: a
    # client cannot see that happen, so it asks again while refused, within a deadline.
    deadline = time.monotonic() + 10
    while True:
        with connect() as sock:  # type: ignore[operator]
            try:
                sock.sendall(probe)
                reply = _reply(sock)
            except (BrokenPipeError, ConnectionResetError):
                # Refused and closed before the probe went out (CI saw EPIPE): ask again.
                reply = {"ok": False, "error": f"already serves {CAP} connections (closed)"}
        if reply["ok"] is True:
            break
        assert f"already serves {CAP} connections" in str(reply["error"]), reply
        assert time.monotonic() < deadline, "the stalled connections' slots were not freed"
        time.sleep(0.01)


def test_stalled_connections_take_at_most_the_cap_of_saver_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(saver._SaverServer, "max_connections", CAP)
    s = CheckpointSaver(str(tmp_path / "s.sock"), shm_prefix=f"dlrtest-{uuid.uuid4().hex[:8]}")
    s.start()
    try:
        _crowd(lambda: _unix(s.socket_path), b'{"op": "held"}\n')
    finally:
        s.close(unlink=True)


def test_stalled_connections_take_at_most_the_cap_of_replica_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(replica._ReplicaServer, "max_connections", CAP)
    exchange = ReplicaExchange(dict, f"dlrtest-{uuid.uuid4().hex[:8]}", "/dev/shm", token="t")
    exchange.start()
    host, _, port = exchange.addr.rpartition(":")
    try:
        _crowd(
            lambda: socket.create_connection((host, int(port)), timeout=10),
            b'{"op": "list", "token": "t"}\n',
        )
    finally:
        exchange.close()


def test_a_push_that_stalls_mid_image_stalls_nothing_else() -> None:
    """The replica server received a pushed image under its one lock: a peer that stopped
    sending in the middle held every list, read and push of the node for up to 30 s per
    stalled read (the fuzzer's valid probe after such a push went unanswered)."""
    exchange = ReplicaExchange(dict, f"dlrtest-{uuid.uuid4().hex[:8]}", "/dev/shm", token="t")
    exchange.start()
    host, _, port = exchange.addr.rpartition(":")

    def connect() -> socket.socket:
        return socket.create_connection((host, int(port)), timeout=5)

    put = b'{"op": "put", "token": "t", "source_node": 1, "slot": 0, "nbytes": 8192}\n'
    try:
        with connect() as pusher:
            pusher.sendall(put)
            pusher.settimeout(5)
            reader = pusher.makefile("rb")
            assert json.loads(reader.readline())["ok"] is True
            pusher.sendall(b"\0" * 100)  # and nothing more
            with connect() as lister:  # answered at once (a 5 s timeout), not after the stall
                lister.sendall(b'{"op": "list", "token": "t"}\n')
                assert _reply(lister) == {
                    "ok": True, "error": "", "segments": [], "nbytes": 0, "meta_len": 0,
                }  # fmt: skip
            with connect() as second:
                second.sendall(put)
                refusal = _reply(second)
            assert refusal["ok"] is False and "is being received" in str(refusal["error"])
            pusher.shutdown(socket.SHUT_WR)  # the push breaks off: the image is torn
            assert json.loads(reader.readline()) == {
                "ok": False, "error": "torn image", "segments": [], "nbytes": 0, "meta_len": 0,
            }  # fmt: skip
            reader.close()
        assert exchange.holdings() == []
    finally:
        exchange.close()


def test_a_connection_that_says_nothing_gives_its_slot_back_quickly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection's first line (its request, with the token) has REQUEST_TIMEOUT_S, not the
    30 s of a transfer: a client without the token held one of the replica port's slots for
    30 s by saying nothing."""
    monkeypatch.setattr(replica, "REQUEST_TIMEOUT_S", 0.5)
    exchange = ReplicaExchange(dict, f"dlrtest-{uuid.uuid4().hex[:8]}", "/dev/shm", token="t")
    exchange.start()
    host, _, port = exchange.addr.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=10) as silent:
            reply = _reply(silent)  # a 10 s client deadline: the server spoke first
        assert reply["ok"] is False and "timed out" in str(reply["error"]), reply
    finally:
        exchange.close()


def test_a_reader_that_stops_reading_stalls_nothing_else() -> None:
    """The replica server sent an image under its one lock: a reader that stopped reading held
    every list and push of the node for up to 30 s per stalled send."""
    name = f"dlrtest-{uuid.uuid4().hex[:8]}"
    own = SharedSegment.create(f"{name}-own", 64 << 20, "/dev/shm")  # more than socket buffers
    try:
        meta = json.dumps({"version": FORMAT_VERSION, "step": 3}).encode()
        publish(own, begin_write(own), 3, own.size - HEADER_SIZE - 4096, meta)
        exchange = ReplicaExchange(lambda: {0: own}, name, "/dev/shm", token="t")
        exchange.start()
        host, _, port = exchange.addr.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=5) as stalled:
                stalled.sendall(b'{"op": "get", "token": "t", "key": "own/0", "step": 3}\n')
                stalled.settimeout(5)
                with stalled.makefile("rb") as reader:
                    assert json.loads(reader.readline())["ok"] is True
                    # ... and reads no more: the server's send blocks on full buffers.
                    with socket.create_connection((host, int(port)), timeout=5) as lister:
                        lister.sendall(b'{"op": "list", "token": "t"}\n')
                        listed = _reply(lister)  # within the 5 s client deadline
                    assert listed["ok"] is True
                    assert [s["key"] for s in listed["segments"]] == ["own/0"]  # type: ignore[union-attr, index]
        finally:
            exchange.close()
    finally:
        own.close(unlink=True)
