"""DLRover's own API inside `dlrover.trainer.torch.inprocess.Wrapper`: ElasticTrainer keeping the
global batch (``prepare``, ``step(fix_total_batch_size=True)``), ElasticDistributedSampler, and
a flash checkpoint of the model, the optimizer and the sampler's place every step, as DLRover's
examples write them.

The model and the optimizer are built once per process, outside the wrapped function; each
entry (the first, and each after a peer's failure) makes the round's process group, wraps the
model in DDP, builds the loader and ElasticTrainer for the round's world, and loads the newest
checkpoint (the sampler goes back to the step every rank finished). The data of a step depends
only on the sampler's place, so a run with failures ends with the failure-free run's model.

Every entry appends ``<rank> <pid> <first step>`` to <out>.entries; every rank appends
``<step> <rank> <sample ids>`` to <out>.ids as it finishes a step (a step cut by a failure and
run again appears twice); rank 0 writes the final SHA-256 to <out>.final. Faults come from
DLROVER_FAULTS (the step counted over the run). ``--sampler dynamic``: DynamicShardSampler
(shards leased from the master, exactly once) instead of ElasticDistributedSampler.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from inprocess_train import append  # beside this script: one line per entry, appended
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from dlrover.testing.digest import tensors_digest
from dlrover.testing.faults import FaultInjector
from dlrover.trainer import StepReporter
from dlrover.trainer.torch.elastic.dynamic_sampler import DynamicShardSampler
from dlrover.trainer.torch.elastic.sampler import ElasticDistributedSampler
from dlrover.trainer.torch.elastic.trainer import ElasticTrainer
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType
from dlrover.trainer.torch.inprocess import Wrapper

MICRO_BATCH, SAMPLES = 4, 256


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--sampler", choices=("elastic", "dynamic"), default="elastic")
    a = p.parse_args()

    FaultInjector.from_env().maybe_inject(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(SAMPLES, 8, generator=g),
        torch.randn(SAMPLES, 1, generator=g),
        torch.arange(SAMPLES),
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ckpt = DdpCheckpointer(a.ckpt)
    progress = StepReporter()

    @Wrapper()
    def train() -> None:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        ddp = DistributedDataParallel(model)
        sampler: ElasticDistributedSampler | DynamicShardSampler = (
            ElasticDistributedSampler(data, shuffle=True, seed=3)
            if a.sampler == "elastic"
            else DynamicShardSampler(
                data,
                shuffle=True,
                seed=3,
                dataset_name="inprocess",
                shard_size=8,
                mode="exactly-once",
            )
        )
        loader = DataLoader(data, batch_size=MICRO_BATCH, sampler=sampler)
        trainer = ElasticTrainer(ddp, dataloader=loader)
        optimizer = trainer.prepare(opt)
        state = ckpt.load_checkpoint()
        step = 0
        if state:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            sampler.load_state_dict(state["sampler"])
            step = int(state["step"])
        append(a.out + ".entries", f"{rank} {os.getpid()} {step + 1}")
        faults = FaultInjector.from_env()
        micro = 0
        ids: list[int] = []
        while step < a.steps:
            for x, y, idx in loader:
                ids += idx.tolist()
                with trainer.step(fix_total_batch_size=True):
                    loss = nn.functional.mse_loss(ddp(x), y) / trainer.gradient_accumulation_steps
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                micro += 1
                if micro % trainer.gradient_accumulation_steps:
                    continue  # the global batch is not complete yet
                step += 1
                append(a.out + ".ids", f"{step} {rank} {' '.join(map(str, ids))}")
                ids = []
                faults.maybe_inject(step)
                state = {
                    "model": model.state_dict(),
                    "optimizer": opt.state_dict(),
                    "step": step,
                    # The samples each rank trained since this entry, the resumed place added.
                    "sampler": sampler.state_after(micro * MICRO_BATCH)
                    if isinstance(sampler, ElasticDistributedSampler)
                    else sampler.state_dict(micro, MICRO_BATCH),
                }
                last = step == a.steps
                ckpt.save_checkpoint(
                    step, state, storage_type=StorageType.DISK if last else StorageType.MEMORY
                )
                progress.report(step)
                if last:
                    break
            sampler.set_epoch(sampler.epoch + 1)
            micro = 0
        ckpt.wait_latest_checkpoint(60)
        if rank == 0:
            with open(a.out + ".final", "w") as f:
                f.write(tensors_digest(model.state_dict().values()))
        dist.destroy_process_group()

    train()


if __name__ == "__main__":
    main()
