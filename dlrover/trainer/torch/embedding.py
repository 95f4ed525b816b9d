"""ElasticEmbedding: an nn.EmbeddingBag whose rows live on the job's embedding servers."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dlrover.client.master_client import MasterClient
from dlrover.constants import (
    ENV_JOB_TOKEN,
    ENV_MASTER_ADDR,
    ENV_PS_ADDRS,
    ENV_PS_WAIT_S,
)
from dlrover.embedding.client import EmbeddingClient
from dlrover.embedding.table import EmbeddingError
from dlrover.embedding.wire import PLACEMENT
from dlrover.envvars import number_from_env
from dlrover.proto import embedding_pb2 as pb


class _Lookup(torch.autograd.Function):
    """Rows of unique ids from the servers; the backward pushes their gradients back, where the
    table's optimizer applies them."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, ids: torch.Tensor, anchor: torch.Tensor, module: ElasticEmbedding
    ) -> torch.Tensor:
        ctx.ids = ids
        ctx.module = module
        rows = module.client.lookup(module.name, ids.numpy(), module.dim)
        return torch.from_numpy(rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:  # type: ignore[override]
        module: ElasticEmbedding = ctx.module
        module.client.push(module.name, ctx.ids.numpy(), grad.contiguous().numpy())
        return None, None, None


class ElasticEmbedding(nn.Module):
    """Like ``nn.EmbeddingBag(mode=...)`` over int64 ids of any size: the table ``name`` lives on
    the embedding servers (``DLROVER_PS_ADDRS``, or ``client=``), rows are created on first use,
    and ``loss.backward()`` pushes the rows' gradients to the servers, which apply the table's
    sparse optimizer (``adagrad`` or ``sgd`` at ``lr``). Dense parameters stay with the model
    (DDP). In a job of several workers each pushes its own gradients (they add up)."""

    def __init__(
        self,
        name: str,
        dim: int,
        mode: str = "sum",
        optimizer: str = "adagrad",
        lr: float = 0.01,
        initial_accumulator: float = 0.0,
        seed: int = 0,
        init_scale: float = 0.0,
        client: EmbeddingClient | None = None,
    ) -> None:
        super().__init__()
        if mode not in ("sum", "mean", "max"):
            raise EmbeddingError(f"mode {mode!r}: use sum, mean or max")
        self.name, self.dim, self.mode = name, dim, mode
        self.spec = pb.TableSpec(
            name=name,
            dim=dim,
            optimizer=optimizer,
            lr=lr,
            initial_accumulator=initial_accumulator,
            seed=seed,
            init_scale=init_scale,
        )
        self.client = client if client is not None else _client_from_env()
        self._anchor = torch.empty(0, requires_grad=True)
        self._created = False

    def forward(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Pooled rows per bag, as ``nn.EmbeddingBag``: ``ids`` (N,) with ``offsets`` (B,), or
        (B, L) bags of equal length."""
        if ids.dtype != torch.int64:
            raise EmbeddingError(
                f"ElasticEmbedding {self.name!r}: ids must be int64, got {ids.dtype} "
                f"(use ids.long())"
            )
        if not self._created:
            self.client.create_table(self.spec)
            self._created = True
        # numpy's unique (a hash, then a sort of the distinct ids) takes a third of
        # torch.unique's time on CPU ids; the servers get the ids sorted and distinct.
        flat = ids.detach().cpu().reshape(-1).numpy()
        distinct, positions = np.unique(flat, return_inverse=True)
        unique = torch.from_numpy(distinct)
        inverse = torch.from_numpy(positions.reshape(ids.shape))
        rows = _Lookup.apply(unique, self._anchor, self)
        return F.embedding_bag(
            inverse, rows, offsets, mode=self.mode, per_sample_weights=per_sample_weights
        )

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The current rows of ``ids`` (no gradient): for evaluation and tests."""
        return torch.from_numpy(self.client.lookup(self.name, ids.numpy(), self.dim))


def _client_from_env() -> EmbeddingClient:
    """The servers in ``DLROVER_PS_ADDRS``, else the placement the job's master published (a
    job with ``roles: {ps: ...}``, waiting up to ``DLROVER_PS_WAIT_S`` for it)."""
    token = os.environ.get(ENV_JOB_TOKEN, "")
    addresses = [a for a in os.environ.get(ENV_PS_ADDRS, "").split(",") if a]
    if addresses:
        return EmbeddingClient(addresses, token)
    if not os.environ.get(ENV_MASTER_ADDR):
        raise EmbeddingError(
            f"ElasticEmbedding needs the job's embedding servers: run under a job with `ps` "
            f"nodes (dlrover submit --ps N), set {ENV_PS_ADDRS}, or pass client="
        )
    wait_s = number_from_env(ENV_PS_WAIT_S, 300.0, "a number of seconds")
    master = MasterClient.from_env()
    try:
        placement = PLACEMENT.get(master, wait_s=wait_s)
    finally:
        master.close()
    if placement is None:
        raise EmbeddingError(
            f"the job's embedding servers were not ready within {wait_s:.0f}s ({ENV_PS_WAIT_S}): "
            "does the job have roles.ps (dlrover submit --ps N)? The master's log says why"
        )
    return EmbeddingClient(placement.addresses, token, bucket_map=placement.map)


__all__ = ["ENV_PS_ADDRS", "ElasticEmbedding"]
