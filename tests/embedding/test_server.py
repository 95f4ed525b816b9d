"""ElasticEmbedding over real embedding servers (gRPC on port 0): training equals a dense
nn.EmbeddingBag + Adagrad on the same rows; bad input and a gone server are clear errors."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch import nn

from dlrover.embedding.buckets import BucketMap
from dlrover.embedding.client import EmbeddingClient, EmbeddingServerUnavailable
from dlrover.embedding.cluster import EmbeddingCluster, ResizeReport
from dlrover.embedding.server import EmbeddingServer
from dlrover.embedding.table import EmbeddingError, initial_rows
from dlrover.trainer.torch.embedding import ElasticEmbedding
from tests.embedding.training import train

TOKEN = "tok"


@pytest.fixture
def servers() -> Iterator[list[EmbeddingServer]]:
    started = [EmbeddingServer(TOKEN).start() for _ in range(2)]
    try:
        yield started
    finally:
        for s in started:
            s.stop(0.1)


def _client(servers: list[EmbeddingServer], **kw: object) -> EmbeddingClient:
    return EmbeddingClient([s.address for s in servers], TOKEN, **kw)  # type: ignore[arg-type]


def test_training_equals_a_dense_embedding_bag_with_adagrad(
    servers: list[EmbeddingServer],
) -> None:
    n, dim, lr = 200, 8, 0.05
    torch.manual_seed(0)
    sparse = ElasticEmbedding("items", dim, mode="mean", lr=lr, seed=7, client=_client(servers))
    dense = nn.EmbeddingBag(n, dim, mode="mean")
    with torch.no_grad():
        dense.weight.copy_(torch.from_numpy(initial_rows(np.arange(n), dim, 7, 1 / np.sqrt(dim))))
    head_s, head_d = nn.Linear(dim, 1), nn.Linear(dim, 1)
    head_d.load_state_dict(head_s.state_dict())
    opt_s = torch.optim.SGD(head_s.parameters(), lr=lr)
    opt_d = torch.optim.SGD(head_d.parameters(), lr=lr)
    opt_e = torch.optim.Adagrad(dense.parameters(), lr=lr, eps=1e-10)
    rng = np.random.default_rng(1)
    for _ in range(10):
        ids = torch.from_numpy(rng.integers(0, n, size=(16, 5)).astype(np.int64))
        y = torch.from_numpy(rng.standard_normal((16, 1)).astype(np.float32))
        for emb, head, opts in ((sparse, head_s, [opt_s]), (dense, head_d, [opt_d, opt_e])):
            for o in opts:
                o.zero_grad()
            nn.functional.mse_loss(head(emb(ids)), y).backward()
            for o in opts:
                o.step()
    every = torch.arange(n, dtype=torch.int64)
    torch.testing.assert_close(sparse.rows(every), dense.weight.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(head_s.weight, head_d.weight, atol=1e-5, rtol=1e-5)
    # Both servers hold rows: the buckets spread the ids.
    stats = sparse.client.stats()
    rows = [sum(t.rows for t in per_server.tables) for per_server in stats]
    assert sum(rows) == n and min(rows) > 0


def test_bad_input_and_a_gone_server_are_clear_errors(servers: list[EmbeddingServer]) -> None:
    emb = ElasticEmbedding("items", 4, client=_client(servers, timeout_s=2.0, settle_s=1.0))
    with pytest.raises(EmbeddingError, match="ids must be int64, got torch.int32"):
        emb(torch.tensor([[1, 2]], dtype=torch.int32))
    client = emb.client
    with pytest.raises(EmbeddingError, match="no table 'other'.*create it first"):
        client.lookup("other", np.array([1], dtype=np.int64), 4)
    wrong = EmbeddingClient([servers[0].address], "nope", BucketMap.even(1), timeout_s=2.0)
    with pytest.raises(EmbeddingError, match="refused the job token"):
        wrong.lookup("items", np.array([1], dtype=np.int64), 4)
    emb(torch.tensor([[1, 2]]))  # creates the table, works
    servers[1].stop(0.1)
    with pytest.raises(EmbeddingServerUnavailable, match=f"server 1 at {servers[1].address}"):
        emb(torch.arange(100).reshape(10, 10))


def test_scaling_two_three_two_servers_mid_training_changes_nothing() -> None:
    servers = [EmbeddingServer(TOKEN).start() for _ in range(3)]
    reference = [EmbeddingServer(TOKEN).start() for _ in range(2)]
    try:
        plain = ElasticEmbedding("items", 8, lr=0.05, client=_client(reference))
        head_plain = train(plain, 30)

        two = [s.address for s in servers[:2]]
        client = EmbeddingClient(two, TOKEN)
        cluster = EmbeddingCluster(client)
        cluster.install()
        emb = ElasticEmbedding("items", 8, lr=0.05, client=client)
        reports: list[ResizeReport] = []
        resizing: list[threading.Thread] = []

        def on_step(step: int) -> None:
            # Resize from another thread while the training loop goes on.
            target = {10: [s.address for s in servers], 20: two}.get(step)
            if target is not None:
                for t in resizing:
                    t.join(30)
                thread = threading.Thread(target=lambda: reports.append(cluster.resize(target)))
                thread.start()
                resizing.append(thread)

        head = train(emb, 30, on_step)
        for t in resizing:
            t.join(30)
        assert [r.servers for r in reports] == [3, 2]
        assert all(r.moved_rows > 0 and r.moved_buckets > 0 for r in reports)
        every = torch.arange(5000, dtype=torch.int64)
        assert torch.equal(emb.rows(every), plain.rows(every))  # bit for bit
        assert torch.equal(head.weight, head_plain.weight)
        stats = client.stats()
        assert [s.map_version for s in stats] == [5, 5]
        assert sum(t.rows for s in stats for t in s.tables) == sum(
            t.rows for s in _client(reference).stats() for t in s.tables
        )  # no row lost or held twice
        # The removed server redirects a client that still routes by the old map.
        stale = EmbeddingClient([s.address for s in servers], TOKEN, BucketMap.even(3))
        assert torch.equal(
            torch.from_numpy(stale.lookup("items", every.numpy(), 8)), plain.rows(every)
        )
        assert stale.placement.map.version == 5
    finally:
        for s in servers + reference:
            s.stop(0.1)
