"""A Megatron-LM style loop with ``--ckpt-format torch_dist`` (Megatron-LM's default) through
DLRover's drop-in ``save_checkpoint``/``load_checkpoint``, called with exactly the arguments
Megatron-LM's ``megatron/training/training.py`` passes today. megatron.core's GPT model on the
CPU (its forward needs CUDA, so a step's loss is over the parameters themselves) and
megatron.core's ``OptimizerParamScheduler``; the optimizer is torch's Adam behind the
checkpoint interface of megatron.core's ``FP32Optimizer`` (``megatron_args.CpuOptimizer``:
FP32Optimizer needs CUDA to be built).

``megatron_torch_dist_loop.py DIR MODE --tp N --steps S [--ckpt CKPT]`` under dlrover-run
(CKPT: Megatron-LM's --save and --load, default DIR/ckpt):
- ``train``: trains from iteration 1 (or what ``load_checkpoint`` finds, after a restart) to
  S, saving every iteration: to storage every 3rd and at S, to memory only otherwise
  (training.py's non-persistent checkpoint); ``--kill-at K``: on the first attempt rank 1 is
  SIGKILLed at iteration K before its save. Writes ``DIR/load_<rank>.json`` (what the load
  found) and ``DIR/state<iteration>_<rank>.pt`` (model and optimizer) at each storage save.
- ``read``: megatron.core's own ``dist_checkpointing.load`` of ``CKPT/iter_<--iteration>``
  at this job's layout, written to ``DIR/read_<rank>.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

# megatron.core imports torch.utils.tensorboard, which imports TensorFlow where it is installed
# (10-20 s per process) and needs none of it.
sys.modules.setdefault("tensorflow", None)  # type: ignore[arg-type]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron_args import CpuOptimizer, stand_in_megatron_training  # noqa: E402

ARGS = stand_in_megatron_training(
    save="", load="", ckpt_format="torch_dist", consumed_train_samples=0, finetune=False,
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
)  # fmt: skip

from dlrover.trainer.torch.flash_checkpoint.megatron import (  # noqa: E402
    checkpointer_for,
    load_checkpoint,
    save_checkpoint,
    wait_latest_checkpoint,
)


def build(tp: int) -> tuple[list[torch.nn.Module], CpuOptimizer, Any]:
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.transformer_config import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    ARGS.tensor_model_parallel_size = tp
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
    )  # fmt: skip
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
        max_sequence_length=16,
    )  # fmt: skip
    optimizer = CpuOptimizer(model)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=2, lr_decay_steps=20,
        lr_decay_style="cosine", start_wd=0.0, end_wd=0.0, wd_incr_steps=20,
        wd_incr_style="constant",
    )  # fmt: skip
    return [model], optimizer, scheduler


def train_step(model: torch.nn.Module, optimizer: CpuOptimizer, iteration: int) -> None:
    """One step of a loss over the parameters themselves, the same on every data-parallel
    replica (as after a gradient all-reduce), with an all-reduce as a real step has."""
    g = torch.Generator().manual_seed(iteration)
    loss = torch.zeros(())
    for _, p in sorted(model.named_parameters()):
        target = torch.randn(p.shape, generator=g)
        loss = loss + (p - target).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    optimizer.step()


def snapshot(model: torch.nn.Module, optimizer: CpuOptimizer, scheduler: Any) -> dict[str, Any]:
    return {
        "model": {
            k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)
        },
        "optimizer": optimizer.state_dict(),
        "lr": optimizer.param_groups[0]["lr"],
        "scheduler": scheduler.state_dict(),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("mode", choices=["train", "read"])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--iteration", type=int, default=0)
    parser.add_argument("--ckpt", default="", help="Megatron-LM's --save/--load (DIR/ckpt)")
    opts = parser.parse_args()
    out = Path(opts.dir)
    ARGS.save = ARGS.load = opts.ckpt or str(out / "ckpt")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optimizer, scheduler = build(opts.tp)
    if opts.mode == "read":
        from megatron.core import dist_checkpointing

        loaded = dist_checkpointing.load(
            {"model": model[0].sharded_state_dict()}, f"{ARGS.load}/iter_{opts.iteration:07d}"
        )
        model[0].load_state_dict(loaded["model"])
        torch.save(snapshot(model[0], optimizer, scheduler)["model"], out / f"read_{rank}.pt")
        return
    # As training.py's setup_model_and_optimizer calls it.
    checkpointing_context: dict[str, Any] = {}
    iteration, _ = load_checkpoint(
        model, optimizer, scheduler, checkpointing_context=checkpointing_context,
        skip_load_to_model_and_opt=False,
    )  # fmt: skip
    source = checkpointer_for().last_load_source
    (out / f"load_{rank}.json").write_text(
        json.dumps({"iteration": iteration, "source": source, "lr": optimizer.param_groups[0]["lr"],
                    "consumed": ARGS.consumed_train_samples})
    )  # fmt: skip
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for it in range(iteration + 1, opts.steps + 1):
        train_step(model[0], optimizer, it)
        scheduler.step(increment=1)
        ARGS.consumed_train_samples += 4
        if first and it == opts.kill_at and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # before its save: memory holds it - 1
        persistent = it % 3 == 0 or it == opts.steps
        # Exactly training.py's call (its non-persistent checkpoint is the memory save).
        save_checkpoint(
            it, model, optimizer, scheduler, 1000.0 * it, checkpointing_context,
            non_persistent_ckpt=not persistent, train_data_iterator=None,
            preprocess_common_state_dict_fn=None,
        )  # fmt: skip
        if persistent:
            torch.save(snapshot(model[0], optimizer, scheduler), out / f"state{it}_{rank}.pt")
            # The memory saves that follow then find a free buffer: which step every rank
            # still holds at the kill (the one to resume from) does not depend on timing.
            assert wait_latest_checkpoint(120)
    assert wait_latest_checkpoint(120)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
