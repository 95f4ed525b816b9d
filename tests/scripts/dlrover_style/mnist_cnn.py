"""An MNIST CNN trained the way DLRover's examples/pytorch/mnist/cnn_train.py trains it:
ElasticDistributedSampler + ElasticDataLoader + ElasticTrainer + DdpCheckpointer, memory saves
every few steps, storage saves less often, the step counted since training began.

The data is synthetic (no download here): 28x28 images whose class is a bright square's place.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from common import record, save_final  # this folder is on sys.path when the script runs
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from dlrover.trainer.torch.elastic.dataloader import ElasticDataLoader
from dlrover.trainer.torch.elastic.sampler import ElasticDistributedSampler
from dlrover.trainer.torch.elastic.trainer import ElasticTrainer
from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer


class SyntheticMNIST(Dataset):  # type: ignore[type-arg]
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(index)
        image = torch.rand(1, 28, 28, generator=g) * 0.3
        label = index % 10
        row, col = divmod(label, 5)
        image[0, 4 + row * 12 : 12 + row * 12, 2 + col * 5 : 6 + col * 5] += 0.7
        return image, label


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.fc1 = nn.Linear(2304, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return F.log_softmax(self.fc2(x), dim=1)


def train(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    print(f"rank {rank} is initialized local_rank = {os.environ['LOCAL_RANK']}", flush=True)
    torch.manual_seed(0)

    train_dataset = SyntheticMNIST(args.dataset_size)
    sampler = ElasticDistributedSampler(dataset=train_dataset)
    train_loader = ElasticDataLoader(
        dataset=train_dataset, batch_size=args.batch_size, sampler=sampler
    )
    model = DDP(Net())
    optimizer = optim.SGD(model.parameters(), lr=args.learning_rate, momentum=args.momentum)
    scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.8)

    checkpointer = DdpCheckpointer(args.ckpt_dir)
    state_dict = checkpointer.load_checkpoint()
    if "model" in state_dict:
        model.load_state_dict(state_dict["model"])
    if "optimizer" in state_dict:
        optimizer.load_state_dict(state_dict["optimizer"])
    if "scheduler" in state_dict:
        scheduler.load_state_dict(state_dict["scheduler"])
    if "sampler" in state_dict:
        train_loader.sampler.load_state_dict(state_dict["sampler"])
    step = state_dict.get("step", 0)
    record(args.out, "start", step=step, source=checkpointer.last_load_source)

    elastic_trainer = ElasticTrainer(model, dataloader=train_loader)
    optimizer, scheduler = elastic_trainer.prepare(optimizer, scheduler)

    start_epoch = train_loader.sampler.epoch
    for epoch in range(start_epoch, args.num_epochs):
        elastic_trainer.reset()
        model.train()
        step = train_epoch(
            step, epoch, elastic_trainer, model, optimizer, scheduler, train_loader,
            checkpointer, args,
        )  # fmt: skip
    save_final(args.out, model.module.state_dict())
    dist.barrier()
    dist.destroy_process_group()


def train_epoch(
    train_step: int,
    epoch: int,
    elastic_trainer: ElasticTrainer,
    model: nn.Module,
    optimizer: optim.Optimizer,
    scheduler: optim.lr_scheduler.StepLR,
    train_loader: ElasticDataLoader,
    checkpointer: DdpCheckpointer,
    args: argparse.Namespace,
) -> int:
    train_loader.sampler.set_epoch(epoch)
    batches = 0
    for data, target in train_loader:
        with elastic_trainer.step(True):
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
            scheduler.step()
            train_step += 1
            batches += 1
            if train_step % args.save_memory_interval == 0:
                sd = {
                    "step": train_step,
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(),
                }
                if isinstance(train_loader.sampler, ElasticDistributedSampler):
                    sd["sampler"] = train_loader.sampler.state_dict(
                        train_step, train_loader.batch_size
                    )
                saved = checkpointer.save_checkpoint(
                    train_step, sd, storage_type=StorageType.MEMORY
                )
                if train_step % args.save_storage_interval == 0:
                    checkpointer.save_checkpoint(train_step, sd, storage_type=StorageType.DISK)
                record(args.out, "saved", step=train_step, returned=saved)
    record(args.out, "epoch", epoch=epoch, batches=batches, step=train_step)
    return train_step


def arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Process training parameters")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--num_epochs", type=int, default=3)
    parser.add_argument("--dataset_size", type=int, default=160)
    parser.add_argument("--momentum", type=float, default=0.5)
    parser.add_argument("--learning_rate", type=float, default=0.05)
    parser.add_argument("--save_memory_interval", type=int, default=5)
    parser.add_argument("--save_storage_interval", type=int, default=20)
    parser.add_argument("--ckpt_dir", required=True)
    parser.add_argument("--out", required=True)
    return parser


if __name__ == "__main__":
    train(arg_parser().parse_args())
