"""A DLRover-style DDP loop over DynamicShardSampler with no Join: set_epoch, one pass, rank 0
saves the model and the sampler state every 4 steps, and every rank resumes from it.

Each rank appends the sample ids it trained to <out>/ids.<epoch>.<rank>.<restart> and, after
each epoch, the number of batches to <out>/batches.<epoch>.<rank>.<restart>; a rank whose pass
was not len(loader) batches exits with an error. Faults come from DLROVER_FAULTS (the step is
counted over the whole run). Usage: script OUT SIZE BATCH EPOCHS.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from dlrover.testing.faults import FaultInjector
from dlrover.trainer import StepReporter
from dlrover.trainer.torch.elastic import DynamicShardSampler


class Numbers(Dataset[int]):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def main() -> None:
    out, size, batch, epochs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    sampler = DynamicShardSampler(Numbers(size), shard_size=7, dataset_name="numbers", seed=1)
    path = os.path.join(out, "ckpt.pt")
    start_epoch = global_step = 0
    if os.path.exists(path):
        state = torch.load(path, weights_only=True)
        model.module.load_state_dict(state["model"])
        sampler.load_state_dict(state["sampler"])
        start_epoch, global_step = state["epoch"], state["global_step"]
    loader = DataLoader(Numbers(size), batch_size=batch, sampler=sampler)
    faults = FaultInjector.from_env()
    progress = StepReporter()
    for epoch in range(start_epoch, epochs):
        sampler.set_epoch(epoch)
        expected = len(loader)
        step = 0  # batches of this pass (since the restore, in the restored epoch)
        with open(os.path.join(out, f"ids.{epoch}.{rank}.{restart}"), "a") as ids:
            for ids_batch in loader:
                opt.zero_grad()
                x = ids_batch.float().unsqueeze(1) / size
                model(x).pow(2).mean().backward()  # DDP all-reduces: every rank must be here
                opt.step()
                step += 1
                global_step += 1
                ids.write("".join(f"{i}\n" for i in ids_batch.tolist()))
                ids.flush()
                progress.report(global_step)
                if rank == 0 and global_step % 4 == 0:
                    tmp = path + ".tmp"
                    torch.save(
                        {
                            "model": model.module.state_dict(),
                            "sampler": sampler.state_dict(step, batch),
                            "epoch": epoch,
                            "global_step": global_step,
                        },
                        tmp,
                    )
                    os.replace(tmp, path)
                faults.maybe_inject(global_step)
        with open(os.path.join(out, f"batches.{epoch}.{rank}.{restart}"), "w") as f:
            f.write(f"{step} {expected}\n")
        if step != expected:
            raise SystemExit(f"rank {rank} epoch {epoch}: {step} batches, len(loader)={expected}")
    dist.destroy_process_group()
    os._exit(0)  # torch+gloo can abort during interpreter shutdown


if __name__ == "__main__":
    main()
