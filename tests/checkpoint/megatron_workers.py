"""One rank of the MegatronCheckpointer test job (megatron.core GPT, gloo, CPU): the parallel
layouts one after another in one process, so that the job pays megatron's start once."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dlrover.constants import ENV_CHECKPOINT_SOCKET
from dlrover.trainer.torch.flash_checkpoint.megatron import MegatronCheckpointer, StorageType

if TYPE_CHECKING:
    from megatron.core.models.gpt.gpt_model import GPTModel

LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}
"""(tensor parallel, pipeline parallel) of each layout the job runs."""


def build_model() -> GPTModel:
    """A 2-layer GPT of this rank's tensor/pipeline stage, initialised on the CPU."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

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


def run(ckpt_dir: Path, args: argparse.Namespace, *, resume: bool, interrupted: bool) -> Any:
    """Build the model, optionally resume, train to ``--steps`` saving to memory each step and
    to storage every ``--disk-every``-th; ``interrupted``: stop at ``--kill-at`` before its save
    (rank 1 SIGKILLed there where ``args.kill``). Returns (load record, final model state)."""
    rank = dist.get_rank()
    model = build_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    ckpt = MegatronCheckpointer(str(ckpt_dir))
    iteration, record = 0, {}
    if resume:
        iteration = ckpt.load_checkpoint(model, optimizer, scheduler)
        record = {"source": ckpt.last_load_source, "iteration": iteration}
    for step in range(iteration + 1, args.steps + 1):
        train_step(model, optimizer, step)
        scheduler.step()
        if interrupted and step == args.kill_at:
            if args.kill and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # before its save: memory holds step - 1
            break  # this layout's run ends here; its memory outlives this process
        disk = step % args.disk_every == 0
        storage = StorageType.DISK if disk else StorageType.MEMORY
        ckpt.save_checkpoint(step, model, optimizer, scheduler, storage_type=storage)
        if disk:  # the next memory saves then find a free buffer: which step loads is fixed
            assert ckpt.wait_latest_checkpoint(120)
    assert ckpt.wait_latest_checkpoint(120)
    ckpt.close()
    final = {k: v.detach().clone() for k, v in model.state_dict().items() if v is not None}
    return record, final


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("launch", choices=["first", "second"])
    parser.add_argument("--out", required=True, help="one directory per layout: <layout>/")
    parser.add_argument("--layouts", required=True, help="comma-separated names of LAYOUTS")
    parser.add_argument("--sockets", required=True, help="one agent saver socket per layout")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--disk-every", type=int, default=3)
    parser.add_argument("--kill-at", type=int, default=5)
    parser.add_argument("--kill", action="store_true", help="rank 1 dies in the last layout")
    args = parser.parse_args()
    # megatron.core imports torch.utils.tensorboard, which imports TensorFlow where it is
    # installed (10-20 s per process here) and needs none of it: without it, tensorboard uses
    # its own stand-in. Nothing in this job uses TensorFlow.
    sys.modules.setdefault("tensorflow", None)  # type: ignore[arg-type]
    from megatron.core import parallel_state

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    layouts = args.layouts.split(",")
    kill = args.kill
    for i, (name, socket_path) in enumerate(zip(layouts, args.sockets.split(","), strict=True)):
        # Each layout's memory lives in its own saver (one agent each), as its own job's would.
        os.environ[ENV_CHECKPOINT_SOCKET] = socket_path
        args.kill = kill and i == len(layouts) - 1
        root = Path(args.out, name)
        root.mkdir(parents=True, exist_ok=True)
        tensor, pipeline = LAYOUTS[name]
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor, pipeline_model_parallel_size=pipeline
        )
        if args.launch == "first":
            _, final = run(root / "ref-ckpt", args, resume=False, interrupted=False)
            torch.save(final, root / f"reference_{rank}.pt")
            run(root / "ckpt", args, resume=False, interrupted=True)
        else:
            record, final = run(root / "ckpt", args, resume=True, interrupted=False)
            (root / f"load_{rank}.json").write_text(json.dumps(record))
            torch.save(final, root / f"resumed_{rank}.pt")
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
