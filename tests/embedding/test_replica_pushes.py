"""What a replica holds as applied: only the pushes whose rows it has (per table). A replica that
claimed a push of another table, whose rows were still only marked as changed, made the
replacement report a too-small gap and drop the push's retry as a duplicate (the update was lost
silently). Also: what a call that does not get through says."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from dlrover.embedding import frames
from dlrover.embedding.client import EmbeddingClient, EmbeddingServerUnavailable
from dlrover.embedding.cluster import EmbeddingCluster
from dlrover.embedding.server import EmbeddingServer
from dlrover.embedding.table import EmbeddingError
from dlrover.proto import embedding_pb2 as pb

TOKEN = "tok"
DIM = 4


def _spec(name: str) -> pb.TableSpec:
    return pb.TableSpec(name=name, dim=DIM, optimizer="sgd", lr=0.1)


def _ids_of(client: EmbeddingClient, server: int, n: int) -> np.ndarray:
    every = np.arange(20 * n, dtype=np.int64)
    return every[client.bucket_map.owner_of(every) == server][:n]


def _failing_for(send: Callable[[Any], None], refuse: Callable[[Any], bool]) -> Any:
    """``send`` (a ReplicaSender's) that refuses the Replicate requests ``refuse`` picks (it is
    given the request's RowsMessage, arrays aside)."""

    def wrapped(request: list[bytes | memoryview]) -> None:
        if refuse(frames.read_rows_message(frames.join(request))[0]):
            raise EmbeddingError("the replica at test did not answer (injected)")
        send(request)

    return wrapped


def _wait_for(what: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _retry(client: EmbeddingClient, address: str, table: str, ids: np.ndarray, seq: int) -> Any:
    request = pb.PushRequest(
        table=table,
        ids=ids.astype("<i8").tobytes(),
        grads=np.ones((ids.size, DIM), dtype="<f4").tobytes(),
        client=client.client_id,
        seq=seq,
    )
    return client.call(address, "Push", request)


@pytest.mark.parametrize("mode", [pb.ASYNC, pb.SYNC])
def test_a_replica_does_not_claim_a_push_whose_rows_it_lacks(mode: int) -> None:
    """Server 1's replication of table "b" fails; its pushes of table "a" reach the replica.
    ASYNC: the flush of "a" sent every push as applied, "b"'s too. SYNC: the resend of earlier
    failed rows of "a" sent every push as applied. Either way the replacement must report the
    "b" push as lost and apply its retry."""
    servers = [EmbeddingServer(TOKEN).start() for _ in range(2)]
    spare = EmbeddingServer(TOKEN).start()
    try:
        client = EmbeddingClient([s.address for s in servers], TOKEN, timeout_s=3)
        cluster = EmbeddingCluster(client, replica=mode)
        cluster.install()
        for name in ("a", "b"):
            client.create_table(_spec(name))
        ids = _ids_of(client, 1, 50)
        grads = np.ones((ids.size, DIM), dtype=np.float32)
        sender = servers[1].service._sender
        assert sender is not None
        down = {"a": mode == pb.SYNC, "b": True}
        sender.send = _failing_for(sender.send, lambda m: down[m.table])  # type: ignore[method-assign]
        client.push("a", ids, grads)  # SYNC: not replicated, marked for the next send of "a"
        client.push("b", ids, grads)  # never replicated
        seq_b = client._seq
        down["a"] = False
        client.push("a", ids, grads)  # SYNC: takes the marked rows of "a" along
        held = servers[0].service.replica
        source = servers[1].service._tables["a"].table

        def caught_up() -> bool:
            table = held.tables.get("a")
            return bool(table is not None and table.holds(ids).all()) and np.array_equal(
                table.snapshot(ids)[0], source.snapshot(ids)[0]
            )

        _wait_for(caught_up)
        before = client.lookup("a", ids, DIM)
        servers[1].stop(0)
        cluster.replace(1, spare.address)
        (gap,) = client.failover_gaps
        assert (gap.pushes, gap.rows) == (1, ids.size), "the push of table b was claimed"
        assert np.array_equal(client.lookup("a", ids, DIM), before)
        # The retry of the lost push is applied (not dropped as a duplicate), once.
        assert not _retry(client, spare.address, "b", ids, seq_b).duplicate
        assert _retry(client, spare.address, "b", ids, seq_b).duplicate
        b_rows = client.lookup("b", ids, DIM)
        a_twice = client.lookup("a", ids, DIM)
        # "b" got one update of -0.1 per column from its initial rows; "a" two.
        assert np.allclose(a_twice - b_rows, -0.1, atol=1e-5)
    finally:
        for s in [*servers, spare]:
            s.stop(0.1)


def test_a_refused_connection_says_so_and_names_the_address() -> None:
    server = EmbeddingServer(TOKEN).start()
    address = server.address
    server.stop(0)
    client = EmbeddingClient([address], TOKEN, timeout_s=30)
    started = time.monotonic()
    with pytest.raises(EmbeddingServerUnavailable) as refused:
        client.call(address, "Stats", pb.StatsRequest())
    assert time.monotonic() - started < 10
    message = str(refused.value)
    assert f"embedding server 0 at {address} is not reachable" in message, message
    assert "within" not in message and "refused" in message
    other = "127.0.0.1:1"  # not in the placement: no index
    with pytest.raises(EmbeddingServerUnavailable) as elsewhere:
        client.call(other, "Stats", pb.StatsRequest())
    assert str(elsewhere.value).startswith(f"embedding server at {other} is not reachable")
    assert "?" not in str(elsewhere.value)
    client.close()


def test_a_server_that_does_not_answer_names_the_deadline() -> None:
    silent = socket.socket()  # accepts connections (backlog), never speaks HTTP/2
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    try:
        client = EmbeddingClient([address], TOKEN, timeout_s=0.5)
        with pytest.raises(EmbeddingServerUnavailable) as late:
            client.call(address, "Stats", pb.StatsRequest())
        assert str(late.value) == f"embedding server 0 at {address} did not answer within 0.5s"
        client.close()
    finally:
        silent.close()


def test_a_floor_counts_only_for_its_table() -> None:
    """Table "a" took pushes 1..N but 5 (table "b"'s, not applied here): a's floor covers 5,
    which must not make the server, or a replica update, claim it."""
    from dlrover.embedding.replica import PUSH_WINDOW, AppliedPushes, claims, combined

    a, b = AppliedPushes(), AppliedPushes()
    for seq in range(1, PUSH_WINDOW + 20):
        if seq != 5:
            a.add("c", seq)
    assert a.of("c")[1] > 5  # the floor passed 5
    seqs, floor = combined([a, b], "c")
    assert floor == -1 and 5 not in seqs and PUSH_WINDOW + 19 in seqs
    b.add("c", 5)
    for seq in range(PUSH_WINDOW + 20, 2 * PUSH_WINDOW + 40):
        b.add("c", seq)
    seqs, floor = combined([a, b], "c")
    assert floor == min(a.of("c")[1], b.of("c")[1]) and (floor >= 5 or 5 in seqs)
    # An update's claims carry no floor; merged, they claim just themselves.
    replica = AppliedPushes()
    replica.merge(claims([("c", 7), ("c", 9)]))
    assert replica.of("c") == ([7, 9], -1)


def test_a_full_resend_replaces_what_the_replica_held_of_a_table() -> None:
    from dlrover.embedding.replica import ReplicaStore, claims, rows_message
    from dlrover.embedding.server import spec_to_table

    store = ReplicaStore(spec_to_table)
    ids = np.arange(3, dtype=np.int64)
    rows = np.zeros((3, DIM), dtype=np.float32)

    def message(*args: Any, **kwargs: Any) -> pb.RowsMessage:
        return pb.RowsMessage.FromString(frames.join(rows_message(*args, **kwargs)))

    store.take(message(_spec("t"), ids, rows, rows, claims([("c", 1)])))
    store.take(message(_spec("u"), ids, rows, rows, claims([("c", 2)])))
    assert store.pushes["t"].of("c") == ([1], -1) and store.pushes["u"].of("c") == ([2], -1)
    store.take(message(_spec("t"), ids[:1], rows[:1], rows[:1], [], reset=True))
    assert store.pushes["t"].of("c") == ([], -1) and len(store.tables["t"]) == 1
    assert store.export("u", np.arange(1), 1).seqs[0].seq == 2
    assert not store.export("t", np.arange(1), 1).seqs
