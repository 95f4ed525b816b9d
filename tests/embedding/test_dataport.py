"""Lookup and Push over a server's data port (plain TCP, dataport.py): the same results as over
gRPC, the token checked on every request, bad frames refused without taking the server down,
and a port that cannot be reached costs speed, not the job."""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from dlrover.embedding import frames
from dlrover.embedding.buckets import BucketMap
from dlrover.embedding.client import EmbeddingClient, EmbeddingServerUnavailable
from dlrover.embedding.cluster import EmbeddingCluster
from dlrover.embedding.dataport import LOOKUP, MALFORMED, OK, REPLY, REQUEST, TOKEN
from dlrover.embedding.server import EmbeddingServer
from dlrover.embedding.table import EmbeddingError
from dlrover.proto import embedding_pb2 as pb

JOB_TOKEN = "tok"
SPEC = pb.TableSpec(name="items", dim=8, optimizer="adagrad", lr=0.05)


@pytest.fixture
def servers() -> Iterator[list[EmbeddingServer]]:
    started = [EmbeddingServer(JOB_TOKEN).start() for _ in range(4)]
    try:
        yield started
    finally:
        for s in started:
            s.stop(0.1)


def _train(client: EmbeddingClient, seed: int) -> np.ndarray:
    """A few steps of lookups and pushes with repeated ids; the final rows of every id."""
    client.create_table(SPEC)
    rng = np.random.default_rng(seed)
    for _ in range(20):
        ids = rng.integers(0, 500, 300).astype(np.int64)
        rows = client.lookup("items", ids, 8)
        client.push("items", ids, (np.sin(rows) + 0.1).astype(np.float32))
    return client.lookup("items", np.arange(500, dtype=np.int64), 8)


def test_the_data_port_trains_to_the_same_rows_as_grpc(servers: list[EmbeddingServer]) -> None:
    fast = EmbeddingClient([s.address for s in servers[:2]], JOB_TOKEN, BucketMap.even(2))
    slow = EmbeddingClient(
        [s.address for s in servers[2:]], JOB_TOKEN, BucketMap.even(2), data_port=False
    )
    try:
        assert np.array_equal(_train(fast, 1), _train(slow, 1))
        assert all(fast._data.get(s.address) is not None for s in servers[:2])  # it was used
        assert not slow._data
    finally:
        fast.close()
        slow.close()


def _frame(method: int, token: bytes, payload: bytes) -> bytes:
    return REQUEST.pack(method, len(token), len(payload)) + token + payload


def _reply(sock: socket.socket) -> tuple[int, bytes]:
    status, size = REPLY.unpack(sock.recv(REPLY.size, socket.MSG_WAITALL))
    return status, sock.recv(size, socket.MSG_WAITALL) if size else b""


def _data_port(server: EmbeddingServer) -> socket.socket:
    port = server.service.data_port
    assert port, "the server has a data port"
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def test_every_request_needs_the_token_and_bad_frames_are_refused_clearly(
    servers: list[EmbeddingServer],
) -> None:
    server = servers[0]
    client = EmbeddingClient([server.address], JOB_TOKEN)
    client.create_table(SPEC)
    lookup = frames.join(frames.lookup_request("items", np.array([3, 4], dtype="<i8")))
    with _data_port(server) as sock:
        sock.sendall(_frame(LOOKUP, JOB_TOKEN.encode(), lookup))
        status, payload = _reply(sock)
        assert status == OK
        rows = np.frombuffer(pb.LookupResponse.FromString(payload).rows, "<f4").reshape(2, 8)
        assert np.array_equal(rows, client.lookup("items", np.array([3, 4]), 8))

        sock.sendall(_frame(LOOKUP, JOB_TOKEN.encode(), b"\x12\x05abc"))  # cut short
        status, payload = _reply(sock)
        assert status == MALFORMED and b"malformed request" in payload

        sock.sendall(_frame(9, JOB_TOKEN.encode(), lookup))
        assert _reply(sock) == (MALFORMED, b"unknown method 9")

        sock.sendall(_frame(LOOKUP, JOB_TOKEN.encode(), lookup))  # the connection goes on
        assert _reply(sock)[0] == OK

        sock.sendall(struct.pack("<BHI", LOOKUP, 3, 1 << 31))  # a length over the limit
        status, payload = _reply(sock)
        assert status == MALFORMED and b"over the limits" in payload
        assert sock.recv(1) == b""  # and that connection is closed
    with _data_port(server) as sock:  # a wrong token: told, and dropped unread
        sock.sendall(_frame(LOOKUP, b"wrong", lookup))
        status, payload = _reply(sock)
        assert status == TOKEN and b"DLROVER_JOB_TOKEN" in payload
        assert sock.recv(1) == b""
    # The server serves on.
    assert client.lookup("items", np.array([3], dtype=np.int64), 8).shape == (1, 8)
    client.close()


def test_a_data_port_that_cannot_be_reached_falls_back_to_grpc(
    servers: list[EmbeddingServer], caplog: pytest.LogCaptureFixture
) -> None:
    server = servers[0]
    server._data.close()  # as if a firewall let gRPC's port through only
    client = EmbeddingClient([server.address], JOB_TOKEN, BucketMap.even(1))
    with caplog.at_level(logging.WARNING, "dlrover.embedding.client"):
        rows = _train(client, 2)
    assert rows.shape == (500, 8) and client._data == {server.address: None}
    assert "data port" in caplog.text and "go over gRPC" in caplog.text
    reference = EmbeddingClient([servers[1].address], JOB_TOKEN, BucketMap.even(1))
    assert np.array_equal(rows, _train(reference, 2))
    client.close()
    reference.close()


def test_a_server_gone_mid_training_is_named_and_its_port_asked_again(
    servers: list[EmbeddingServer],
) -> None:
    server = servers[0]
    client = EmbeddingClient([server.address], JOB_TOKEN, timeout_s=2.0, settle_s=0.5)
    _train(client, 3)
    server.stop(0.1)
    with pytest.raises(EmbeddingServerUnavailable, match=f"server 0 at {server.address}"):
        client.lookup("items", np.array([1], dtype=np.int64), 8)
    assert server.address not in client._data  # asked for again once it answers
    client.close()


def test_a_kept_connection_the_server_closed_is_replaced_at_once_and_a_refusal_keeps_it(
    servers: list[EmbeddingServer],
) -> None:
    server = servers[0]
    client = EmbeddingClient([server.address], JOB_TOKEN, BucketMap.even(1), timeout_s=5.0)
    client.create_table(SPEC)
    before = client.lookup("items", np.arange(10, dtype=np.int64), 8)
    channel = client._data[server.address]
    assert channel is not None and len(channel._free) == 1
    # The server ends its side of the kept connection (as after IDLE_TIMEOUT_S).
    for conn in list(server._data._connections):
        conn.shutdown(socket.SHUT_RDWR)
    assert np.array_equal(client.lookup("items", np.arange(10, dtype=np.int64), 8), before)
    assert client._data[server.address] is channel  # no failover, no re-discovery
    # A refusal is an answer: the connection it came on is kept for the next request.
    kept = channel._free[0]
    with pytest.raises(Exception, match="no table 'other'"):
        client.lookup("other", np.array([1], dtype=np.int64), 8)
    assert channel._free == [kept]
    client.close()


def test_a_server_at_its_connection_cap_says_busy_and_is_asked_again(
    servers: list[EmbeddingServer],
) -> None:
    server = servers[0]
    server._data._slots = threading.BoundedSemaphore(1)  # a cap of one connection
    client = EmbeddingClient([server.address], JOB_TOKEN, BucketMap.even(1), settle_s=1.0)
    client.create_table(SPEC)
    hog = socket.create_connection(("127.0.0.1", server.service.data_port))  # takes it
    with pytest.raises(EmbeddingError, match=r"refused for 1s \(last: .*the most at once"):
        client.lookup("items", np.array([1], dtype=np.int64), 8)
    hog.close()  # its slot frees; the client's next ask gets through
    client.settle_s = 10.0
    assert client.lookup("items", np.array([1], dtype=np.int64), 8).shape == (1, 8)
    client.close()


def test_replicas_go_over_grpc_when_the_next_servers_data_port_cannot_be_reached(
    servers: list[EmbeddingServer],
) -> None:
    pair = servers[:2]
    pair[1]._data.close()  # the replica's data port is out of reach
    client = EmbeddingClient([s.address for s in pair], JOB_TOKEN, BucketMap.even(2))
    EmbeddingCluster(client, replica=pb.SYNC).install()
    ids = np.arange(200, dtype=np.int64)
    _train(client, 4)
    sender = pair[0].service._sender
    assert sender is not None and sender._data is None and sender.failures == 0
    mine = ids[client.bucket_map.owner_of(ids) == 0]
    rows, accum = pair[0].service._tables["items"].table.snapshot(mine)
    held = pair[1].service.replica.tables["items"].snapshot(mine)
    assert np.array_equal(held[0], rows) and np.array_equal(held[1], accum)
    client.close()
