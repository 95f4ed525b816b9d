"""A megatron.core GPT training process for the MegatronCheckpointer tests (gloo, CPU)."""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from dlrover.trainer.torch.flash_checkpoint.megatron import MegatronCheckpointer, StorageType


def build_model() -> GPTModel:
    """A 2-layer GPT of this rank's tensor/pipeline stage, initialised on the CPU."""
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=64,
        max_sequence_length=16,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )


def train_step(model: GPTModel, optimizer: torch.optim.Optimizer, step: int) -> None:
    """One optimizer step of a loss over the parameters themselves (megatron.core's forward
    needs CUDA), with an all-reduce as a real step has: no rank runs ahead of the others."""
    g = torch.Generator().manual_seed(step)
    loss = torch.zeros(())
    for p in model.parameters():
        loss = loss + (p - torch.randn(p.shape, generator=g)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    optimizer.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--disk-every", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=-1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp
    )
    rank = dist.get_rank()
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    ckpt = MegatronCheckpointer(args.ckpt)
    iteration = ckpt.load_checkpoint(model, optimizer, scheduler)
    record = {"source": ckpt.last_load_source, "iteration": iteration}
    Path(args.out, f"load_{rank}.json").write_text(json.dumps(record))
    for step in range(iteration + 1, args.steps + 1):
        train_step(model, optimizer, step)
        scheduler.step()
        if step == args.kill_at and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # before its save: memory holds step - 1
        disk = step % args.disk_every == 0
        storage = StorageType.DISK if disk else StorageType.MEMORY
        ckpt.save_checkpoint(step, model, optimizer, scheduler, storage_type=storage)
        if disk:  # the next memory saves then find a free buffer: which step loads is fixed
            assert ckpt.wait_latest_checkpoint(120)
    assert ckpt.wait_latest_checkpoint(120)
    final = {k: v.detach().clone() for k, v in model.state_dict().items() if v is not None}
    torch.save(final, Path(args.out, f"final_{rank}.pt"))
    ckpt.close()


if __name__ == "__main__":
    main()
