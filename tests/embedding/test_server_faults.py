"""Embedding servers under load and mid-change: SYNC replicas between two busy servers, a
failover of a server whose replica never saw a table, a push retried after its rows moved,
and a map change that waits only for the requests admitted before it."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import numpy as np
import pytest

from dlrover.embedding import replica
from dlrover.embedding.buckets import BucketMap
from dlrover.embedding.client import EmbeddingClient
from dlrover.embedding.cluster import EmbeddingCluster
from dlrover.embedding.server import EmbeddingServer
from dlrover.embedding.wire import Placement
from dlrover.proto import embedding_pb2 as pb

TOKEN = "tok"


def _spec(name: str, dim: int = 4) -> pb.TableSpec:
    return pb.TableSpec(name=name, dim=dim, optimizer="sgd", lr=0.1)


def test_two_busy_servers_replicating_synchronously_to_each_other_do_not_stall(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every request thread of both servers pushing while each pushes to the other's replica:
    the replicas still get through (lookups and pushes never take every thread)."""
    monkeypatch.setattr(replica, "SEND_TIMEOUT_S", 3.0)  # a stall shows as failures, quickly
    servers = [EmbeddingServer(TOKEN, threads=4).start() for _ in range(2)]
    try:
        client = EmbeddingClient([s.address for s in servers], TOKEN, timeout_s=10)
        EmbeddingCluster(client, replica=pb.SYNC).install()
        client.create_table(_spec("t"))
        rng = np.random.default_rng(0)
        batches = [rng.integers(0, 10_000, size=512).astype(np.int64) for _ in range(48)]

        def push(ids: np.ndarray) -> None:
            client.push("t", ids, np.ones((ids.size, 4), dtype=np.float32))

        started = time.monotonic()
        with futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(push, batches))
        took = time.monotonic() - started
        failures = [s.service._sender.failures for s in servers]  # type: ignore[union-attr]
        assert failures == [0, 0], f"replicas missed updates ({failures}) in {took:.1f}s"
        # Each replica holds exactly its neighbour's rows.
        every = np.unique(np.concatenate(batches))
        for i, server in enumerate(servers):
            held = server.service.replica.tables["t"]
            mine = client.bucket_map.owner_of(every) == (i + 1) % 2
            assert len(held) == int(mine.sum())
    finally:
        for s in servers:
            s.stop(0.1)


def test_a_server_whose_replica_never_saw_a_table_is_still_replaced() -> None:
    """A table only looked up (nothing to replicate yet) comes back from its seed on the
    replacement; the updated table from the replica."""
    servers = [EmbeddingServer(TOKEN).start() for _ in range(3)]
    spare = EmbeddingServer(TOKEN).start()
    try:
        client = EmbeddingClient([s.address for s in servers[:2]], TOKEN, timeout_s=3)
        cluster = EmbeddingCluster(client, replica=pb.SYNC)
        cluster.install()
        client.create_table(_spec("pushed"))
        client.create_table(pb.TableSpec(name="looked", dim=4, seed=5, init_scale=0.1))
        ids = np.arange(2000, dtype=np.int64)
        client.push("pushed", ids, np.ones((ids.size, 4), dtype=np.float32))
        looked = client.lookup("looked", ids, 4)
        pushed = client.lookup("pushed", ids, 4)
        servers[1].stop(0.1)
        report = cluster.replace(1, spare.address)
        assert report.restored_rows > 0
        assert np.array_equal(client.lookup("pushed", ids, 4), pushed)
        assert np.array_equal(client.lookup("looked", ids, 4), looked)
    finally:
        for s in [*servers, spare]:
            s.stop(0.1)


def test_a_push_retried_after_its_rows_moved_is_not_applied_twice() -> None:
    """Server A applied client c's push 7, but its answer was lost; the rows moved to B; the
    retry of push 7 reaches B, which knows it from the moved rows."""
    a, b = EmbeddingServer(TOKEN).start(), EmbeddingServer(TOKEN).start()
    try:
        client = EmbeddingClient([a.address], TOKEN, BucketMap.even(1))
        client.create_table(_spec("t"))
        ids = np.arange(100, dtype=np.int64)
        grads = np.ones((ids.size, 4), dtype=np.float32)
        request = pb.PushRequest(
            table="t", ids=ids.tobytes(), grads=grads.tobytes(), client="c", seq=7
        )
        assert client.call(a.address, "Push", request).applied == 100
        rows = client.lookup("t", ids, 4)
        client.call(b.address, "CreateTable", pb.CreateTableRequest(spec=_spec("t")))
        buckets = np.arange(BucketMap.even(1).num_buckets, dtype="<i8")
        moved = client.call(
            a.address,
            "ExportBuckets",
            pb.BucketsRequest(table="t", buckets=buckets.tobytes(), num_buckets=buckets.size),
        )
        client.call(b.address, "ImportRows", moved)
        assert client.call(b.address, "Push", request).duplicate
        on_b = EmbeddingClient([b.address], TOKEN, BucketMap.even(1))
        assert np.array_equal(on_b.lookup("t", ids, 4), rows)
    finally:
        a.stop(0.1)
        b.stop(0.1)


def test_a_new_map_waits_only_for_requests_admitted_before_it() -> None:
    server = EmbeddingServer(TOKEN).start()
    try:
        service = server.service
        ids = np.arange(10, dtype=np.int64)

        def set_map(version: int) -> None:
            placement = Placement(BucketMap(version, BucketMap.even(1).owners), (server.address,))
            client = EmbeddingClient([server.address], TOKEN, timeout_s=30)
            client.call(server.address, "SetMap", pb.SetMapRequest(map=placement.to_proto()))

        set_map(1)
        before = service._enter(ids)  # a request admitted under version 1, still running
        changed = threading.Thread(target=set_map, args=(2,))
        changed.start()
        deadline = time.monotonic() + 10
        while service._placement.map.version != 2:  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.01)
        after = service._enter(ids)  # admitted under version 2: the change need not wait for it
        assert changed.is_alive()  # still waits for the request of version 1
        service._leave(before)
        changed.join(10)
        assert not changed.is_alive(), "the map change waited for a request admitted after it"
        service._leave(after)
    finally:
        server.stop(0.1)


def test_an_async_failover_says_which_acknowledged_updates_it_lost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With an ASYNC replica that has not caught up (here: never, its lag set to a minute), a
    failover loses the pushes the failed server acknowledged: the client names them."""
    monkeypatch.setattr(replica, "ASYNC_LAG_S", 60.0)
    servers = [EmbeddingServer(TOKEN).start() for _ in range(2)]
    spare = EmbeddingServer(TOKEN).start()
    try:
        client = EmbeddingClient([s.address for s in servers], TOKEN, timeout_s=3)
        cluster = EmbeddingCluster(client, replica=pb.ASYNC)
        cluster.install()
        client.create_table(_spec("t"))
        rng = np.random.default_rng(1)
        pushes, rows = 0, 0
        for _ in range(5):
            ids = rng.integers(0, 100_000, size=300).astype(np.int64)
            client.push("t", ids, np.ones((ids.size, 4), dtype=np.float32))
            on_one = int((client.bucket_map.owner_of(ids) == 1).sum())
            pushes, rows = pushes + (on_one > 0), rows + on_one
        servers[1].stop(0)
        cluster.replace(1, spare.address)
        (gap,) = client.failover_gaps
        assert (gap.index, gap.failed, gap.replacement) == (1, servers[1].address, spare.address)
        assert (gap.pushes, gap.rows) == (pushes, rows) and pushes == 5
    finally:
        for s in [*servers, spare]:
            s.stop(0.1)
