"""A DeepSpeed training process for the DeepSpeedCheckpointer tests (one per rank, gloo)."""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import deepspeed
import torch

from dlrover.trainer.torch.flash_checkpoint.deepspeed import DeepSpeedCheckpointer, StorageType


def build_engine(stage: int) -> Any:
    """A small MLP under ZeRO ``stage`` with Adam and a warm-up LR schedule, same init everywhere."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.Linear(32, 1)
    )
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def train_step(engine: Any, step: int, rank: int) -> None:
    """One step on a batch fixed by (step, rank), so every run sees the same data."""
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(4, 8, generator=g)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()


def module_state(engine: Any) -> dict[str, torch.Tensor]:
    """The full model (ZeRO-3 parameters gathered), as CPU tensors."""
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=engine.zero_optimization_stage() == 3):
        return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "load-own"])
    parser.add_argument("--stage", type=int, required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--disk-every", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--own-save", default="")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    out = Path(args.out)
    engine = build_engine(args.stage)
    if args.mode == "load-own":  # DeepSpeed alone reads what the agent wrote
        path, client = engine.load_checkpoint(args.ckpt)
        record = {"path": path, "client": client, "global_steps": engine.global_steps}
        (out / f"load_own_{rank}.json").write_text(json.dumps(record))
        torch.save(module_state(engine), out / f"load_own_{rank}.pt")
        # An explicit end: left to interpreter exit, a ZeRO-3 rank at times aborted in C++
        # teardown ("terminate called without an active exception") after its work was done.
        torch.distributed.destroy_process_group()
        return
    ckpt = DeepSpeedCheckpointer(engine, args.ckpt)
    path, client = ckpt.load_checkpoint()
    record = {"source": ckpt.last_load_source, "path": path, "client": client}
    record["global_steps"] = engine.global_steps
    (out / f"load_{rank}.json").write_text(json.dumps(record))
    while engine.global_steps < args.steps:
        train_step(engine, engine.global_steps, rank)
        step = engine.global_steps
        if step == args.kill_at and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # before step's save: memory holds step - 1
        disk = step % args.disk_every == 0
        storage = StorageType.DISK if disk else StorageType.MEMORY
        ckpt.save_checkpoint(args.ckpt, client_state={"step": step}, storage_type=storage)
        if disk:  # the next memory saves then find a free buffer: which step loads is fixed
            assert ckpt.wait_latest_checkpoint(120)
    assert ckpt.wait_latest_checkpoint(120)
    if args.own_save:  # DeepSpeed's own files of the same state, to compare with ours
        engine.save_checkpoint(args.own_save, client_state={"step": engine.global_steps})
    torch.save(module_state(engine), out / f"final_{rank}.pt")
    ckpt.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
