"""Elastic data-parallel training with a fixed global batch: the same model at any node count.

    dlrover submit --nnodes 1:3 --auto-scale examples/train_elastic.py --ckpt /tmp/elastic-ckpt

`ElasticTrainer` splits each global batch into micro-batches over however many workers the job
has now (gradient accumulation), so a step is the same work and the same update at 1, 2 or 3
nodes, and the auto-scaler can compare step rates across node counts. Flash checkpoints (memory
every step, disk every ``--disk-every``) let a job that re-forms with more or fewer nodes go on
from its last step. ``--sample-time`` simulates an accelerator's time per sample, so that on a
CPU machine the throughput scales with the number of nodes as it would with a GPU each.

Rank 0 prints progress; with ``--out`` it writes the final parameters to ``<out>.pt`` and one
line per step (step, world size) to ``<out>.steps``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from dlrover.trainer import StepReporter
from dlrover.trainer.torch.elastic.trainer import ElasticTrainer
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of ``step``: the same on every rank and at every world size."""
    x = torch.randn(size, 16, generator=torch.Generator().manual_seed(step))
    return x, x.sum(dim=1, keepdim=True).tanh()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--global-batch", type=int, default=12, help="samples per optimizer step")
    p.add_argument("--micro-batch", type=int, default=1, help="samples per forward/backward")
    p.add_argument("--sample-time", type=float, default=0.01, help="simulated seconds per sample")
    p.add_argument(
        "--serial-time",
        type=float,
        default=0.0,
        help="simulated seconds per step that no "
        "number of workers shortens (a serial part: data loading, a parameter sync)",
    )
    p.add_argument("--ckpt", required=True, help="flash checkpoint directory (shared by nodes)")
    p.add_argument("--disk-every", type=int, default=10, help="persist every k steps")
    p.add_argument("--out", default="", help="write <out>.pt (final parameters), <out>.steps")
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ckpt = DdpCheckpointer(a.ckpt)
    state = ckpt.load_checkpoint()
    start = 1
    if state:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"]) + 1
    ddp = DDP(model)  # broadcasts rank 0's parameters
    trainer = ElasticTrainer(ddp, opt, a.global_batch, a.micro_batch, world)
    progress = StepReporter()
    if rank == 0:
        print(f"world size {world}: from step {start}, {trainer.gradient_accumulation_steps} "
              f"micro-batches per rank per step", flush=True)  # fmt: skip
    t0 = time.monotonic()
    for step in range(start, a.steps + 1):
        began = time.monotonic()
        x, y = global_batch(step, a.global_batch)
        time.sleep(a.serial_time)
        data_s = time.monotonic() - began  # the input pipeline's part of the step
        for k in range(trainer.gradient_accumulation_steps):
            first = (k * world + rank) * a.micro_batch  # micro-batch k of this rank
            xb, yb = x[first : first + a.micro_batch], y[first : first + a.micro_batch]
            with trainer.micro_step():
                loss = nn.functional.mse_loss(ddp(xb), yb)
                time.sleep(a.sample_time * len(xb))  # the accelerator's share of the work
                trainer.backward(loss)
        if rank == 0 and a.out:  # before the save: a step saved is a step logged
            with open(a.out + ".steps", "a") as f:
                f.write(f"{step} {world}\n")
        storage = StorageType.DISK if step % a.disk_every == 0 else StorageType.MEMORY
        saving = time.monotonic()
        ckpt.save_checkpoint(
            step,
            {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
            storage_type=storage,
        )
        if storage == StorageType.DISK:
            ckpt.wait_latest_checkpoint(60)  # so the next memory saves are not skipped
        # dlrover status, dlrover top and the dashboard break the step time down with these,
        # and chart this rank's samples per second.
        samples = trainer.gradient_accumulation_steps * a.micro_batch
        progress.report(
            step, data_s=data_s, checkpoint_s=time.monotonic() - saving, samples=samples
        )
        if rank == 0 and (step % 20 == 0 or step == a.steps):
            rate = (step - start + 1) / (time.monotonic() - t0)
            print(f"step {step}/{a.steps} world {world} steps/s {rate:.2f}", flush=True)
    ckpt.wait_latest_checkpoint(60)
    if rank == 0 and a.out:
        torch.save(model.state_dict(), a.out + ".pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
