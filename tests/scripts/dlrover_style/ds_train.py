"""A DeepSpeed script written the way DLRover's ``examples/pytorch/nanogpt/ds_train.py`` and its
flash-checkpoint blog write one: ``DeepSpeedCheckpointer(model, checkpoint_dir)``,
``checkpointer.load_checkpoint(checkpoint_dir)`` and, every few steps,
``checkpointer.save_checkpoint(checkpoint_dir, tag=steps, storage_type=StorageType.MEMORY)``
(and ``DISK``), the step count taken back from ``model.global_steps``. ``--tag loss`` names each
step as DeepSpeed's getting-started tutorial does (``ckpt_id = loss.item()``); ``--kill_at s``
SIGKILLs rank 1 of the first attempt right after its memory save of step s.

The batch of a step is a function of (step, rank): a run resumed at step s trains what the
failure-free run trained after s. At the end every rank loads the newest step back with
DeepSpeed's own ``engine.load_checkpoint`` (it reads ``latest``) and an older one by its tag
through the checkpointer, and records what each held."""

from __future__ import annotations

import argparse
import os
import signal

import deepspeed
import torch
from common import record, save_final  # this folder is on sys.path when the script runs

from dlrover.trainer.torch.flash_checkpoint.deepspeed import DeepSpeedCheckpointer, StorageType


def build(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(1337)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
        "zero_optimization": {"stage": args.zero},
        "steps_per_print": 10_000,
    }
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    return engine


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + int(os.environ["RANK"]))
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def module_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    params = list(model.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=model.zero_optimization_stage() == 3):
        return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--save_dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--max_iters", type=int, default=12)
    parser.add_argument("--save_memory_interval", type=int, default=1)
    parser.add_argument("--save_storage_interval", type=int, default=4)
    parser.add_argument("--zero", type=int, default=2)
    parser.add_argument("--tag", choices=["step", "loss"], default="step")
    parser.add_argument("--kill_at", type=int, default=0, help="rank 1 of the first attempt")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")

    model = build(args)
    checkpoint_dir = args.save_dir
    os.makedirs(checkpoint_dir, exist_ok=True)
    checkpointer = DeepSpeedCheckpointer(model, checkpoint_dir)
    checkpointer.load_checkpoint(checkpoint_dir)
    total_steps = model.global_steps
    record(args.out, "start", step=total_steps, source=checkpointer.last_load_source)

    tags: dict[int, str] = {}
    while total_steps < args.max_iters:
        x, y = batch(total_steps)
        loss = torch.nn.functional.mse_loss(model(x), y)
        model.backward(loss)
        model.step()
        total_steps += 1
        tag = total_steps if args.tag == "step" else loss.item()
        if total_steps % args.save_memory_interval == 0:
            checkpointer.save_checkpoint(checkpoint_dir, tag=tag, storage_type=StorageType.MEMORY)
            record(args.out, "saved", step=total_steps, returned=True, tag=str(tag))
            first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            if total_steps == args.kill_at and first and os.environ["RANK"] == "1":
                os.kill(os.getpid(), signal.SIGKILL)
        if total_steps % args.save_storage_interval == 0:
            checkpointer.save_checkpoint(checkpoint_dir, tag=tag, storage_type=StorageType.DISK)
            tags[total_steps] = str(tag)
    assert checkpointer.wait_latest_checkpoint(120)
    final = module_state(model)
    save_final(args.out, final)
    record(args.out, "trained", step=total_steps, tags={str(k): v for k, v in tags.items()})

    # DeepSpeed's own loader reads the newest step through `latest`.
    again = build(args)
    path, _ = again.load_checkpoint(checkpoint_dir)
    same = all(torch.equal(final[k], v) for k, v in module_state(again).items())
    record(args.out, "deepspeed_load", path=path, steps=again.global_steps, same=same)
    # An older step by its tag, through the checkpointer.
    if tags and args.tag == "step":
        older = sorted(tags)[-2]
        path, _ = DeepSpeedCheckpointer(again, checkpoint_dir).load_checkpoint(
            checkpoint_dir, tag=tags[older]
        )
        record(args.out, "tag_load", path=path, steps=again.global_steps, wanted=older)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
