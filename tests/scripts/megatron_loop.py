"""A Megatron-LM style loop through DLRover's drop-in functions: ``save_checkpoint`` and
``load_checkpoint`` of ``dlrover.trainer.torch.flash_checkpoint.megatron`` with the directories in
Megatron-LM's global arguments. Megatron-LM's ``megatron.training`` is not on PyPI, so its
``get_args`` is stood in for by a module holding the two arguments the functions read.

``megatron_loop.py DIR train`` under dlrover-run: the first attempt trains 4 iterations (saves: 3
to disk, 4 to memory only), writes the state at each iteration to ``DIR/state<n>.pt`` and fails;
the restarted attempt loads (from the agent's memory) and writes what it got to
``DIR/restarted.pt``. ``megatron_loop.py DIR load`` (a plain process) loads from storage and
writes what it got to ``DIR/loaded.pt``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import types

import torch

training = types.ModuleType("megatron.training")
ARGS = argparse.Namespace(save="", load="")
training.get_args = lambda: ARGS  # type: ignore[attr-defined]
if importlib.util.find_spec("megatron") is None:
    sys.modules["megatron"] = types.ModuleType("megatron")
sys.modules["megatron.training"] = training

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


def main() -> None:
    directory, mode = sys.argv[1], sys.argv[2]
    ARGS.save = ARGS.load = f"{directory}/ckpt"
    model, optimizer, scheduler = build()
    if mode == "load" or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        iteration, flops = load_checkpoint(model, optimizer, scheduler)
        out = "loaded" if mode == "load" else "restarted"
        torch.save({"iteration": iteration, "flops": flops, "model": model[0].state_dict(),
                    "lr": scheduler.get_last_lr()}, f"{directory}/{out}.pt")  # fmt: skip
        return
    assert load_checkpoint(model, optimizer, scheduler) == (0, 0.0)  # nothing saved yet
    for iteration in range(1, 5):
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(iteration))
        loss = model[0](x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        torch.save(model[0].state_dict(), f"{directory}/state{iteration}.pt")
        if iteration >= 3:
            storage = StorageType.DISK if iteration == 3 else StorageType.MEMORY
            assert save_checkpoint(iteration, model, optimizer, scheduler, 1000.0 * iteration,
                                   storage_type=storage)  # fmt: skip
    sys.exit("failing after iteration 4, to be restarted")


if __name__ == "__main__":
    main()
