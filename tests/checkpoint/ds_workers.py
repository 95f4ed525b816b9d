"""One rank of the DeepSpeedCheckpointer test job (gloo, CPU): ZeRO stages one after another
in one process, so that the job pays DeepSpeed's start once for all of them."""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path
from typing import Any

import deepspeed
import torch

from dlrover.constants import ENV_CHECKPOINT_SOCKET
from dlrover.trainer.torch.flash_checkpoint.deepspeed import DeepSpeedCheckpointer, StorageType


def build_engine(stage: int) -> Any:
    """A small MLP under ZeRO ``stage`` with Adam and a warm-up LR schedule, same init everywhere."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
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


def train(
    engine: Any, ckpt: DeepSpeedCheckpointer, args: argparse.Namespace, interrupted: bool = False
) -> None:
    """Train up to step ``--steps``, saving to memory each step and to storage every
    ``--disk-every``-th; ``interrupted``: stop at step ``--kill-at`` before its save (rank 1
    SIGKILLed there where ``args.kill``)."""
    rank = torch.distributed.get_rank()
    while engine.global_steps < args.steps:
        train_step(engine, engine.global_steps, rank)
        step = engine.global_steps
        if interrupted and step == args.kill_at:
            if args.kill and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # before step's save: memory holds step - 1
            return  # this stage's run ends here; its memory outlives this process
        disk = step % args.disk_every == 0
        storage = StorageType.DISK if disk else StorageType.MEMORY
        ckpt.save_checkpoint(client_state={"step": step}, storage_type=storage)
        if disk:  # the next memory saves then find a free buffer: which step loads is fixed
            assert ckpt.wait_latest_checkpoint(120)


def first_launch(stage: int, root: Path, args: argparse.Namespace) -> None:
    """The failure-free run (our files, then DeepSpeed's own of the same state), then the run
    that stops at ``--kill-at`` (rank 1 SIGKILLed there where ``--kill``)."""
    rank = torch.distributed.get_rank()
    engine = build_engine(stage)
    ckpt = DeepSpeedCheckpointer(engine, str(root / "ref-ckpt"))
    train(engine, ckpt, args)
    assert ckpt.wait_latest_checkpoint(120)
    engine.save_checkpoint(str(root / "own"), client_state={"step": engine.global_steps})
    torch.save(module_state(engine), root / f"reference_{rank}.pt")
    ckpt.close()
    engine.destroy()

    engine = build_engine(stage)
    ckpt = DeepSpeedCheckpointer(engine, str(root / "ckpt"))
    train(engine, ckpt, args, interrupted=True)
    ckpt.close()
    engine.destroy()


def second_launch(stage: int, root: Path, args: argparse.Namespace) -> None:
    """The restarted run resumes (from memory) and finishes; then DeepSpeed alone loads the
    failure-free run's files."""
    rank = torch.distributed.get_rank()
    engine = build_engine(stage)
    ckpt = DeepSpeedCheckpointer(engine, str(root / "ckpt"))
    path, client = ckpt.load_checkpoint()
    record = {"source": ckpt.last_load_source, "path": path, "client": client}
    record["global_steps"] = engine.global_steps
    (root / f"load_{rank}.json").write_text(json.dumps(record))
    train(engine, ckpt, args)
    assert ckpt.wait_latest_checkpoint(120)
    torch.save(module_state(engine), root / f"resumed_{rank}.pt")
    ckpt.close()
    engine.destroy()

    engine = build_engine(stage)
    path, client = engine.load_checkpoint(str(root / "ref-ckpt"))
    record = {"path": path, "client": client, "global_steps": engine.global_steps}
    (root / f"load_own_{rank}.json").write_text(json.dumps(record))
    torch.save(module_state(engine), root / f"load_own_{rank}.pt")
    train_step(engine, engine.global_steps, rank)  # one step more: what a reshard must match
    torch.save(module_state(engine), root / f"continued_{rank}.pt")
    engine.destroy()


def reshard_launch(stage: int, root: Path, args: argparse.Namespace) -> None:
    """One rank where two saved: the failure-free run's last step loads from storage through
    the checkpointer (its ZeRO state re-partitioned), then the step after it trains on both
    ranks' batches at once (the same mean gradient as the two ranks' all-reduce)."""
    engine = build_engine(stage)
    ckpt = DeepSpeedCheckpointer(engine, str(root / "ref-ckpt"))
    path, client = ckpt.load_checkpoint()
    record = {"source": ckpt.last_load_source, "path": path, "client": client}
    record["global_steps"] = engine.global_steps
    (root / "reshard.json").write_text(json.dumps(record))
    torch.save(module_state(engine), root / "resharded.pt")
    step = engine.global_steps
    batches = [
        torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + r)) for r in (0, 1)
    ]
    loss = engine(torch.cat(batches)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    torch.save(module_state(engine), root / "resharded_step.pt")
    ckpt.close()
    engine.destroy()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("launch", choices=["first", "second", "reshard"])
    parser.add_argument("--out", required=True, help="one directory per stage: zero<stage>/")
    parser.add_argument("--stages", required=True, help="comma-separated ZeRO stages")
    parser.add_argument("--sockets", required=True, help="one agent saver socket per stage")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--disk-every", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=5)
    parser.add_argument("--kill", action="store_true", help="rank 1 dies in the last stage")
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    stages = [int(s) for s in args.stages.split(",")]
    sockets = args.sockets.split(",")
    kill = args.kill
    for i, (stage, socket_path) in enumerate(zip(stages, sockets, strict=True)):
        # Each stage's memory lives in its own saver (one agent each), as its own job's would.
        os.environ[ENV_CHECKPOINT_SOCKET] = socket_path
        args.kill = kill and i == len(stages) - 1
        root = Path(args.out, f"zero{stage}")
        root.mkdir(parents=True, exist_ok=True)
        launch = {"first": first_launch, "second": second_launch, "reshard": reshard_launch}[
            args.launch
        ]
        launch(stage, root, args)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
