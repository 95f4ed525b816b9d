"""gloo training with DynamicShardSampler where only rank 0 saves the checkpoint.

The DLRover-style script: `if rank == 0: torch.save({..., "sampler": sampler.state_dict(step,
batch)})`. Ranks step in lockstep (gradients are all-reduced every step). The sampler gives
every rank the same count, so no rank runs out first; the loop still checks, with an all-reduce
of who has a batch, and a rank without one would contribute zeros. Each rank appends the sample ids it trained
to <out>/ids.<rank>.<restart>. Faults come from DLROVER_FAULTS. Usage: script OUT SIZE BATCH.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dlrover.testing.faults import FaultInjector
from dlrover.trainer import StepReporter
from dlrover.trainer.torch.elastic.dynamic_sampler import DynamicShardSampler


class Numbers(Dataset[int]):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def main() -> None:
    out, size, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    sampler = DynamicShardSampler(Numbers(size), shard_size=10, dataset_name="numbers")
    path = os.path.join(out, "ckpt.pt")
    if os.path.exists(path):
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        sampler.load_state_dict(state["sampler"])
    loader = DataLoader(Numbers(size), batch_size=batch, sampler=sampler)
    faults = FaultInjector.from_env()
    progress = StepReporter()
    step = 0  # micro-batches this rank trained in this iteration
    batches = iter(loader)
    with open(os.path.join(out, f"ids.{rank}.{restart}"), "w") as ids:
        while True:
            ids_batch = next(batches, None)
            have = torch.tensor([0 if ids_batch is None else 1])
            dist.all_reduce(have)
            if int(have.item()) == 0:
                break
            opt.zero_grad()
            if ids_batch is not None:
                x = ids_batch.float().unsqueeze(1) / size
                model(x).pow(2).mean().backward()
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
            opt.step()
            if ids_batch is None:
                continue
            step += 1
            ids.write("".join(f"{i}\n" for i in ids_batch.tolist()))
            ids.flush()
            progress.report(step)
            if rank == 0 and step % 3 == 0:
                tmp = path + ".tmp"
                torch.save(
                    {"model": model.state_dict(), "sampler": sampler.state_dict(step, batch)}, tmp
                )
                os.replace(tmp, path)
            faults.maybe_inject(step)
    dist.destroy_process_group()
    os._exit(0)  # torch+gloo can abort during interpreter shutdown


if __name__ == "__main__":
    main()
