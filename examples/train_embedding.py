"""Wide & Deep on synthetic click data, its sparse features on DLRover's embedding servers.

    dlrover submit --ps 2 --nproc-per-node 2 examples/train_embedding.py --steps 300

Each sample has 13 dense features and 26 categorical fields whose ids follow a power law, as in
Criteo's click logs; the label comes from a fixed hidden rule, so the loss falls. The deep part
pools an 8-dim ElasticEmbedding over the fields into an MLP, the wide part sums a 1-dim one;
both tables live on the job's `dlrover-ps` servers (rows created on first use, Adagrad applied
there), the MLP is DDP. Step s's global batch is generated from (seed, s) alone and each rank
takes its slice, so a run is reproducible at any world size. While it trains,
`dlrover scale NAME --role ps --count 3` adds a server, and a killed server is replaced from
its replica; neither stops this loop.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dlrover.trainer.torch.embedding import ElasticEmbedding

FIELDS, DENSE, VOCAB = 26, 13, 20_000
"""Categorical fields, dense features, distinct values per field."""


def batch(step: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids (size, FIELDS) int64, dense (size, DENSE), labels (size, 1)) of global step ``step``."""
    rng = np.random.default_rng([seed, step])
    values = np.minimum(rng.zipf(1.3, size=(size, FIELDS)) - 1, VOCAB - 1)
    ids = values + np.arange(FIELDS) * VOCAB  # each field its own id range
    dense = rng.standard_normal((size, DENSE)).astype(np.float32)
    # The rule to learn: the parity of field 0's value, field 1's value mod 3, a dense feature.
    hidden = 2.0 * (values[:, 0] % 2) - 1 + (values[:, 1] % 3 - 1) + dense[:, 0]
    labels = (hidden > 0).astype(np.float32)[:, None]
    return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(dense), torch.from_numpy(labels)


class WideAndDeep(nn.Module):
    """The dense half of the model (the embedding tables are on the servers)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim + DENSE, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, deep: torch.Tensor, wide: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        return self.mlp(torch.cat([deep, dense], dim=1)) + wide


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--out", default="", help="rank 0 writes OUT.steps and the model to OUT.pt")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    torch.manual_seed(0)
    deep = ElasticEmbedding("deep", a.dim, mode="mean", lr=0.1, seed=1, init_scale=0.05)
    wide = ElasticEmbedding("wide", 1, mode="sum", lr=0.1, seed=2)
    model = DDP(WideAndDeep(a.dim))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    share = a.global_batch // world
    t0 = time.monotonic()
    for step in range(1, a.steps + 1):
        ids, dense, labels = batch(step, a.global_batch, a.seed)
        mine = slice(rank * share, (rank + 1) * share)
        logits = model(deep(ids[mine]), wide(ids[mine]), dense[mine])
        loss = nn.functional.binary_cross_entropy_with_logits(logits, labels[mine])
        opt.zero_grad()
        loss.backward()  # pushes the rows' gradients to their servers; DDP averages the MLP's
        opt.step()
        time.sleep(a.step_time)
        if rank == 0:
            if a.out:
                with open(a.out + ".steps", "a") as f:
                    f.write(f"{step} {world} {restarts}\n")
            if step % 50 == 0 or step == a.steps:
                rate = step / (time.monotonic() - t0)
                print(
                    f"step {step}/{a.steps} loss {loss.item():.4f} steps/s {rate:.1f}", flush=True
                )
    dist.barrier()  # every rank's last pushes are in before the rows are read
    if rank == 0 and a.out:
        seen = torch.unique(torch.cat([batch(s, a.global_batch, a.seed)[0].reshape(-1)
                                       for s in range(1, a.steps + 1)]))  # fmt: skip
        torch.save(
            {"mlp": model.module.state_dict(), "ids": seen,
             "deep": deep.rows(seen), "wide": wide.rows(seen)},
            a.out + ".pt",
        )  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
