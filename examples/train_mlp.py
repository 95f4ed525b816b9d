"""Train a small MLP with DDP on synthetic data: runs unchanged under torchrun and dlrover-run.

    dlrover-run --standalone --nproc_per_node=2 examples/train_mlp.py --steps 200

Each rank prints nothing but rank 0 prints step, loss and samples/s. The data are a fixed
random regression problem, so the loss must fall.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument(
        "--out", default="", help="Write the final loss and parameter checksum here."
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    true_w = torch.randn(32, 1, generator=torch.Generator().manual_seed(1))

    data_gen = torch.Generator().manual_seed(100 + rank)
    first_loss = last_loss = 0.0
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch_size, 32, generator=data_gen)
        y = x @ true_w
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        last_loss = loss.item()
        if step == 1:
            first_loss = last_loss
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            rate = step * args.batch_size * world / (time.perf_counter() - t0)
            print(f"step {step}/{args.steps} loss {last_loss:.4f} samples/s {rate:.0f}", flush=True)

    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    if args.out:
        with open(f"{args.out}.rank{rank}", "w") as f:
            f.write(
                f"{first_loss} {last_loss} {checksum!r} {world} {os.environ.get('GROUP_RANK')}\n"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
