"""A character-level GPT trained the way DLRover's examples/pytorch/nanogpt/train.py trains it:
a dict of model and checkpoint parameters, ElasticTrainer(model=..., dataloader=...) and
prepare(optimizer), the script's own gradient accumulation, a save to memory every
``--save_memory_interval`` iterations and to storage every ``--save_storage_interval``, the
iteration counted since training began. With ``--fsdp 1`` or ``--fsdp 2`` the model is sharded
(FSDP1 without a device mesh, as DLRover's fsdp_train.py wraps it, or FSDP2's fully_shard) and
FsdpShardCheckpointer saves it, as fsdp_train.py does.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from common import record, save_final  # this folder is on sys.path when the script runs
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from dlrover.trainer.torch.elastic.dataloader import ElasticDataLoader
from dlrover.trainer.torch.elastic.sampler import ElasticDistributedSampler
from dlrover.trainer.torch.elastic.trainer import ElasticTrainer
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType
from dlrover.trainer.torch.flash_checkpoint.fsdp import FsdpShardCheckpointer

TEXT = "the quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs. "


class GPTDataset(Dataset):  # type: ignore[type-arg]
    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        # Whole global batches (4 x 2 ranks): DLRover's sampler state counts steps since training
        # began, which is exact only then.
        return (len(self.data) - self.block_size - 1) // 8 * 8

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i : i + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, batch_first=True)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_embd: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd, 2) for _ in range(n_layer)])
        self.head = nn.Linear(n_embd, vocab_size)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1)))
        logits = self.head(self.blocks(x))
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def setup_train_params(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    world_size = int(os.getenv("WORLD_SIZE", 1))
    torch.manual_seed(1337)
    grad_accum_steps = max(1, args.gradient_accumulation_steps // world_size)
    chars = sorted(set(TEXT))
    data = torch.tensor([chars.index(c) for c in TEXT * 3])
    train_dataset = GPTDataset(data, args.block_size)
    sampler = ElasticDistributedSampler(dataset=train_dataset)
    train_loader = ElasticDataLoader(train_dataset, batch_size=args.batch_size, sampler=sampler)
    model: nn.Module = GPT(len(chars), args.block_size, args.n_layer, args.n_embd)
    if args.fsdp == 1:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(model, device_id=torch.device("cpu"))
    elif args.fsdp == 2:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block)
        fully_shard(model)
    else:
        model = DDP(model)
    elastic_trainer = ElasticTrainer(model=model, dataloader=train_loader)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.1)
    optimizer = elastic_trainer.prepare(optimizer)
    model_params = {
        "model": model,
        "context": contextlib.nullcontext(),
        "grad_accum_steps": grad_accum_steps,
        "total_steps": 0,
        "train_loader": train_loader,
        "elastic_trainer": elastic_trainer,
        "optimizer": optimizer,
    }
    checkpointer = (
        FsdpShardCheckpointer(args.save_dir) if args.fsdp else DdpCheckpointer(args.save_dir)
    )
    ckpt_params = {
        "checkpointer": checkpointer,
        "checkpoint_dir": args.save_dir,
        "save_memory_interval": args.save_memory_interval,
        "save_storage_interval": args.save_storage_interval,
    }
    return model_params, ckpt_params


def load_checkpoint(
    args: argparse.Namespace, model_params: dict[str, Any], ckpt_params: dict[str, Any]
) -> None:
    model = model_params["model"]
    optimizer = model_params["optimizer"]
    train_loader = model_params["train_loader"]
    checkpointer = ckpt_params["checkpointer"]
    os.makedirs(ckpt_params["checkpoint_dir"], exist_ok=True)
    if args.fsdp:
        ckpt_dict = checkpointer.load_checkpoint(model, optimizer)  # the saved extra_sd
    else:
        ckpt_dict = checkpointer.load_checkpoint()
        if "model" in ckpt_dict:
            model.load_state_dict(ckpt_dict["model"])
        if "optimizer" in ckpt_dict:
            optimizer.load_state_dict(ckpt_dict["optimizer"])
    if "sampler" in ckpt_dict:
        train_loader.sampler.load_state_dict(ckpt_dict["sampler"])
    model_params["total_steps"] = ckpt_dict.get("step", 0)
    record(
        args.out, "start", step=model_params["total_steps"], source=checkpointer.last_load_source
    )


def save_checkpoint(
    args: argparse.Namespace, model_params: dict[str, Any], ckpt_params: dict[str, Any]
) -> None:
    steps = model_params["total_steps"]
    checkpointer = ckpt_params["checkpointer"]
    train_loader = model_params["train_loader"]
    for interval, storage in (
        (ckpt_params["save_memory_interval"], StorageType.MEMORY),
        (ckpt_params["save_storage_interval"], StorageType.DISK),
    ):
        if steps % interval:
            continue
        sampler_sd = train_loader.sampler.state_dict(steps, train_loader.batch_size)
        if args.fsdp:
            extra_sd = {"step": steps, "sampler": sampler_sd}
            saved = checkpointer.save_checkpoint(
                steps,
                model_params["model"],
                model_params["optimizer"],
                extra_sd,
                storage_type=storage,
            )
        else:
            state_dict = {
                "model": model_params["model"].state_dict(),
                "optimizer": model_params["optimizer"].state_dict(),
                "step": steps,
                "sampler": sampler_sd,
            }
            saved = checkpointer.save_checkpoint(steps, state_dict, storage_type=storage)
        record(args.out, "saved", step=steps, returned=saved, storage=storage.name)


def train(args: argparse.Namespace) -> None:
    model_params, ckpt_params = setup_train_params(args)
    load_checkpoint(args, model_params, ckpt_params)
    model = model_params["model"]
    optimizer = model_params["optimizer"]
    train_loader = model_params["train_loader"]
    elastic_trainer = model_params["elastic_trainer"]
    grad_accum_steps = model_params["grad_accum_steps"]
    start_epoch = train_loader.sampler.epoch
    for epoch in range(start_epoch, args.epochs):
        train_loader.sampler.set_epoch(epoch)
        batches = 0
        for idx, (data, target) in enumerate(train_loader):
            model_params["total_steps"] += 1
            with elastic_trainer.step():
                with model_params["context"]:
                    _, loss = model(data, target)
                loss = loss / grad_accum_steps
                loss.backward()
                if (idx + 1) % grad_accum_steps == 0:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            batches += 1
            save_checkpoint(args, model_params, ckpt_params)
            # Termination conditions
            if model_params["total_steps"] >= args.max_iters:
                break
        if model_params["total_steps"] >= args.max_iters:
            break
        record(args.out, "epoch", epoch=epoch, batches=batches, step=model_params["total_steps"])
    if args.fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        save_final(args.out, full)
    else:
        save_final(args.out, model.module.state_dict())
    dist.barrier()
    dist.destroy_process_group()


def arg_parser() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Process training parameters")
    parser.add_argument("--save_dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--block_size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--n_embd", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
    parser.add_argument("--save_memory_interval", type=int, default=20)
    parser.add_argument("--save_storage_interval", type=int, default=60)
    parser.add_argument("--max_iters", type=int, default=1 << 30)
    parser.add_argument("--fsdp", type=int, default=0, choices=[0, 1, 2])
    return parser.parse_args()


if __name__ == "__main__":
    train(arg_parser())
