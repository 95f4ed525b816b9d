"""A deterministic model over an ElasticEmbedding, shared by the embedding tests."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from dlrover.trainer.torch.embedding import ElasticEmbedding


def train(
    emb: ElasticEmbedding, steps: int, on_step: Callable[[int], None] = lambda step: None
) -> nn.Linear:
    """A deterministic model over ``emb``: the same data every run."""
    torch.manual_seed(0)
    head = nn.Linear(emb.dim, 1)
    opt = torch.optim.SGD(head.parameters(), lr=0.05)
    rng = np.random.default_rng(3)
    for step in range(steps):
        on_step(step)
        ids = torch.from_numpy(rng.integers(0, 5000, size=(64, 4)).astype(np.int64))
        y = torch.from_numpy(rng.standard_normal((64, 1)).astype(np.float32))
        opt.zero_grad()
        nn.functional.mse_loss(head(emb(ids)), y).backward()
        opt.step()
    return head
