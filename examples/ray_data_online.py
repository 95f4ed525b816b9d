"""A DDP job as the sink of a Ray Data pipeline, exactly once across failures (docs/streaming.md).

    ray start --head --port 6380 --num-cpus 2
    dlrover-run --standalone --nproc-per-node=2 --max-restarts=3 examples/ray_data_online.py \\
        --ray-address 127.0.0.1:6380 --ckpt /tmp/ray-ckpt --steps 200

The pipeline (``ray.data.range`` -> ``map_batches`` computing features ``x`` and a label ``y =
sum(x) + noise``) runs once, in the Ray cluster; the two ranks lease ranges of its rows from the
job master, train a linear model with DDP and save a flash checkpoint every step (to storage
every 20) holding the stream's position with the model: a restarted worker resumes from it,
no row trained twice or skipped. ``--mode at-most-once`` never hands a row out twice instead,
and prints how many the model never trained.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import ray
import ray.data
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from dlrover.trainer import StepReporter
from dlrover.trainer.torch.elastic.ray_source import RayDataSource
from dlrover.trainer.torch.elastic.stream import ElasticStreamDataset
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType


def features(batch: dict[str, Any]) -> dict[str, Any]:
    """The preprocessing, run by Ray upstream of the job: 8 features and a label per id."""
    rng = np.random.default_rng(batch["id"])
    x = rng.uniform(-1, 1, size=(len(batch["id"]), 8)).astype(np.float32)
    y = x.sum(axis=1) + rng.normal(0, 0.01, size=len(x)).astype(np.float32)
    return {"x": list(x), "y": y}


def decode(row: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(row["x"]), torch.tensor([row["y"]], dtype=torch.float32)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ray-address", required=True, help="the Ray cluster (ray start --head)")
    p.add_argument("--ckpt", required=True, help="checkpoint directory")
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--mode", default=None, help="at-least-once, exactly-once, at-most-once")
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ray.init(address=a.ray_address, log_to_driver=False, logging_level="ERROR")
    ray.data.DataContext.get_current().enable_progress_bars = False
    pipeline = ray.data.range(a.rows, override_num_blocks=8).map_batches(features)
    source = RayDataSource(pipeline, name="regression")
    dataset = ElasticStreamDataset(source, decode=decode, mode=a.mode)
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = DdpCheckpointer(a.ckpt)
    step = 0
    state = ckpt.load_checkpoint()
    if state:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        dataset.load_state_dict(state["stream"])
        step = int(state["step"])
    progress = StepReporter()
    for x, y in DataLoader(dataset, batch_size=a.batch, num_workers=0):
        if step >= a.steps:
            break
        step += 1
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        to_storage = step % 20 == 0
        ckpt.save_checkpoint(
            step,
            {
                "model": model.module.state_dict(),
                "optimizer": opt.state_dict(),
                "stream": dataset.state_dict(),  # the rows this step has trained
                "step": step,
            },
            storage_type=StorageType.DISK if to_storage else StorageType.MEMORY,
        )
        if to_storage:
            ckpt.wait_latest_checkpoint(60)
        progress.report(step)
        if rank == 0 and step % 20 == 0:
            print(f"step {step}/{a.steps} loss {loss.item():.4f}", flush=True)
    ckpt.wait_latest_checkpoint(60)
    if rank == 0 and dataset.spec.mode.value == "at-most-once":
        print(f"rows never trained: {dataset.client.progress().lost_records}", flush=True)
    dataset.close()
    dist.barrier()  # every rank is done reading: the pipeline's blocks may go
    if rank == 0:
        source.release()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
