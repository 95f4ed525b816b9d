"""A Megatron-LM style loop through DLRover's drop-in functions: ``save_checkpoint`` and
``load_checkpoint`` of ``dlrover.trainer.torch.flash_checkpoint.megatron`` with the directories in
Megatron-LM's global arguments. Megatron-LM's ``megatron.training`` is not on PyPI, so its
``get_args`` is stood in for by a module holding the two arguments the functions read.

``megatron_loop.py DIR train [STYLE]`` under dlrover-run: the first attempt trains 4 iterations
(saves: 3 to disk, 4 to memory only), writes the state at each iteration to ``DIR/state<n>.pt``
and fails; the restarted attempt loads (from the agent's memory) and writes what it got to
``DIR/restarted.pt``. ``megatron_loop.py DIR load [STYLE]`` (a plain process) loads from storage
and writes what it got to ``DIR/loaded.pt``. STYLE ``dlrover`` (the default) calls the functions
as DLRover's documents show (``storage_type=``); ``today`` calls them with exactly the arguments
Megatron-LM's ``megatron/training/training.py`` passes today (the memory save as its
non-persistent checkpoint), with a batch-size ramp-up counted in ``args.consumed_train_samples``
and a data iterator that has Energon's ``save_state``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from megatron_args import stand_in_megatron_training

ARGS = stand_in_megatron_training(save="", load="", consumed_train_samples=0, finetune=False)

from dlrover.trainer.torch.flash_checkpoint.megatron import (  # noqa: E402
    StorageType,
    load_checkpoint,
    save_checkpoint,
)


def build() -> tuple[list[torch.nn.Module], torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    return [model], optimizer, torch.optim.lr_scheduler.StepLR(optimizer, 2)


RAMP_UP = {1: 2, 2: 4, 3: 8, 4: 8}
"""Samples of each iteration: a global batch-size ramp-up, as --rampup-batch-size makes."""


class DataIterator:
    """A data iterator with Energon's ``save_state`` (Megatron-LM saves what it returns)."""

    def __init__(self) -> None:
        self.position = 0

    def save_state(self) -> dict[str, int]:
        return {"position": self.position}


def load_today(model: list[torch.nn.Module], optimizer: Any, scheduler: Any) -> tuple[int, float]:
    """As training.py's ``setup_model_and_optimizer`` calls it."""
    checkpointing_context: dict[str, Any] = {}
    world = dist.group.WORLD
    return load_checkpoint(
        model,
        optimizer,
        scheduler,
        checkpointing_context=checkpointing_context,
        skip_load_to_model_and_opt=False,
        tp_group=world,
        pp_group=world,
        dp_cp_group=world,
        dp_group=world,
        expt_dp_group=world,
        rng_state_key_prefix="",
    )


def main() -> None:
    directory, mode = sys.argv[1], sys.argv[2]
    today = len(sys.argv) > 3 and sys.argv[3] == "today"
    ARGS.save = ARGS.load = f"{directory}/ckpt"
    if today:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model, optimizer, scheduler = build()
    load = load_today if today else load_checkpoint
    if mode == "load" or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        iteration, flops = load(model, optimizer, scheduler)
        out = "loaded" if mode == "load" else "restarted"
        torch.save({"iteration": iteration, "flops": flops, "model": model[0].state_dict(),
                    "lr": scheduler.get_last_lr(), "consumed": ARGS.consumed_train_samples},
                   f"{directory}/{out}.pt")  # fmt: skip
        return
    assert load(model, optimizer, scheduler) == (0, 0.0)  # nothing saved yet
    data_iterator = DataIterator()
    for iteration in range(1, 5):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(iteration))
        loss = model[0](x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        ARGS.consumed_train_samples += RAMP_UP[iteration]
        data_iterator.position += RAMP_UP[iteration]
        torch.save(model[0].state_dict(), f"{directory}/state{iteration}.pt")
        if iteration >= 3 and today:  # exactly training.py's call
            checkpointing_context: dict[str, Any] = {}
            world = dist.group.WORLD
            save_checkpoint(
                iteration,
                model,
                optimizer,
                scheduler,
                1000.0 * iteration,
                checkpointing_context,
                non_persistent_ckpt=iteration == 4,
                train_data_iterator=data_iterator,
                preprocess_common_state_dict_fn=lambda state: state,
                tp_group=world,
                pp_group=world,
                dp_cp_group=world,
                dp_group=world,
                expt_dp_group=world,
                rng_state_key_prefix="",
            )
        elif iteration >= 3:
            storage = StorageType.DISK if iteration == 3 else StorageType.MEMORY
            assert save_checkpoint(iteration, model, optimizer, scheduler, 1000.0 * iteration,
                                   storage_type=storage)  # fmt: skip
    sys.exit("failing after iteration 4, to be restarted")


if __name__ == "__main__":
    main()
