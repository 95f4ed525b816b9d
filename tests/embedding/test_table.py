"""The sparse table and the bucket map: vectorised, deterministic, and equal to torch's dense
embedding + Adagrad on the same rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dlrover.embedding.buckets import BucketMap, bucket_of
from dlrover.embedding.table import EmbeddingError, EmbeddingTable, Optimizer, initial_rows


def test_rows_start_from_the_seed_and_the_id_alone() -> None:
    a, b = EmbeddingTable("t", 8, seed=3), EmbeddingTable("t", 8, seed=3)
    ids = np.array([5, 1, 99, 5], dtype=np.int64)
    b.lookup(np.array([7, 99], dtype=np.int64))  # another order, other ids first
    rows = a.lookup(ids)
    assert np.array_equal(rows, b.lookup(ids))
    assert np.array_equal(rows[0], rows[3]) and len(a) == 3
    assert not np.array_equal(rows[0], rows[1])
    assert not np.array_equal(rows, EmbeddingTable("t", 8, seed=4).lookup(ids))
    assert np.abs(rows).max() <= 1 / np.sqrt(8)


@pytest.mark.parametrize("name", ["adagrad", "sgd"])
def test_updates_equal_torch_dense_embedding_and_optimizer(name: str) -> None:
    n, dim, lr = 50, 4, 0.1
    table = EmbeddingTable("t", dim, Optimizer(name, lr=lr), seed=1)
    dense = torch.nn.Embedding(n, dim)
    with torch.no_grad():
        dense.weight.copy_(torch.from_numpy(initial_rows(np.arange(n), dim, 1, 0.5)))
    table.init_scale = 0.5
    opt = (
        torch.optim.Adagrad(dense.parameters(), lr=lr, eps=1e-10)
        if name == "adagrad"
        else torch.optim.SGD(dense.parameters(), lr=lr)
    )
    rng = np.random.default_rng(0)
    for _ in range(5):
        ids = rng.integers(0, n, size=32).astype(np.int64)  # repeats included
        target = torch.from_numpy(rng.standard_normal((32, dim)).astype(np.float32))
        # dense
        opt.zero_grad()
        out = dense(torch.from_numpy(ids))
        ((out - target) ** 2).sum().backward()
        opt.step()
        # sparse: the same loss's gradient per looked-up row
        rows = torch.from_numpy(table.lookup(ids)).requires_grad_()
        ((rows - target) ** 2).sum().backward()
        assert rows.grad is not None
        table.apply_gradients(ids, rows.grad.numpy())
    every = np.arange(n, dtype=np.int64)
    np.testing.assert_allclose(table.lookup(every), dense.weight.detach().numpy(), atol=1e-6)


def test_bad_ids_and_gradients_are_clear_errors() -> None:
    table = EmbeddingTable("clicks", 4)
    with pytest.raises(EmbeddingError, match="ids must be int64, got int32"):
        table.lookup(np.array([1, 2], dtype=np.int32))
    with pytest.raises(EmbeddingError, match=r"need gradients of shape \(2, 4\)"):
        table.apply_gradients(np.array([1, 2]), np.zeros((2, 3), dtype=np.float32))


def test_buckets_move_with_their_rows_and_optimizer_state() -> None:
    source, target = EmbeddingTable("t", 4), EmbeddingTable("t", 4)
    ids = np.arange(1000, dtype=np.int64)
    source.apply_gradients(ids, np.ones((1000, 4), dtype=np.float32))
    before = source.lookup(ids)
    moving = np.array([3, 7, 8], dtype=np.int64)
    moved_ids, rows, accum = source.export_buckets(moving, 16)
    assert set(bucket_of(moved_ids, 16)) == {3, 7, 8}
    target.import_rows(moved_ids, rows, accum)
    assert source.drop_buckets(moving, 16) == moved_ids.size
    assert len(source) + len(target) == 1000
    staying = ids[~np.isin(ids, moved_ids)]
    np.testing.assert_array_equal(source.lookup(staying), before[staying])
    np.testing.assert_array_equal(target.lookup(moved_ids), before[moved_ids])
    # The optimizer state moved too: the next step is the same wherever the row lives.
    ref = EmbeddingTable("t", 4)
    ref.apply_gradients(ids, np.ones((1000, 4), dtype=np.float32))
    grads = np.full((moved_ids.size, 4), 0.5, dtype=np.float32)
    ref.apply_gradients(moved_ids, grads)
    target.apply_gradients(moved_ids, grads)
    np.testing.assert_array_equal(target.lookup(moved_ids), ref.lookup(moved_ids))


def test_bucket_map_resizes_with_the_fewest_moves_and_stays_even() -> None:
    two = BucketMap.even(2, 1024)
    three = two.resized(3)
    counts = np.bincount(three.owners, minlength=3)
    assert counts.max() - counts.min() <= 1 and three.version == 2
    assert len(two.moves(three)) == counts[2]  # only what the new server must take
    back = three.resized(2)
    assert len(three.moves(back)) == counts[2]  # only the removed server's buckets
    ids = np.arange(100_000, dtype=np.int64)
    owners = back.owner_of(ids)
    assert set(np.unique(owners)) == {0, 1}
    assert abs(np.mean(owners) - 0.5) < 0.01  # ids spread evenly
    assert np.array_equal(bucket_of(ids, 1024), bucket_of(ids.copy(), 1024))


def test_a_table_grows_past_its_first_capacity() -> None:
    table = EmbeddingTable("t", 4, seed=2, capacity=2)
    ids = np.arange(10, dtype=np.int64)
    np.testing.assert_array_equal(table.lookup(ids), initial_rows(ids, 4, 2, 0.5))
    assert len(table) == 10


def test_applied_pushes_remember_a_window_then_a_floor_and_merge() -> None:
    from dlrover.embedding.replica import PUSH_WINDOW, AppliedPushes

    pushes = AppliedPushes()
    pushes.add("c", 5)
    pushes.add("c", 3)  # out of order: both applied, 4 not
    assert pushes.applied("c", 3) and pushes.applied("c", 5) and not pushes.applied("c", 4)
    for seq in range(10, 10 + PUSH_WINDOW + 5):
        pushes.add("c", seq)
    assert pushes.applied("c", 4)  # below the floor now: counted as applied
    assert not pushes.applied("c", 10_000) and not pushes.applied("other", 1)
    replacement = AppliedPushes()
    replacement.merge(pushes.entries())
    assert replacement.applied("c", 10 + PUSH_WINDOW + 4) and replacement.applied("c", 4)
    assert not replacement.applied("c", 10_000)
