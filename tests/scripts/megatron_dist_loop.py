"""A Megatron-LM style loop with ``--use-distributed-optimizer`` through DLRover's
``megatron_dist_ckpt`` drop-ins, called with exactly the arguments Megatron-LM's training.py
passes. megatron-core's DistributedOptimizer needs CUDA, so the optimizer here is a ZeRO-1 Adam
of its own with the two methods of megatron-core's that the drop-ins use
(``get_parameter_state_dp_reshardable`` / ``load_parameter_state_from_dp_reshardable``): each
data-parallel rank keeps the fp32 parameters and moments of its shard only, as Megatron's does.
Megatron-LM's ``get_args`` is stood in for by a module holding the arguments the functions read.

``megatron_dist_loop.py OUT [--kill-at N]`` under dlrover-run (2 ranks): iterations 1..6, a
save every iteration (to storage at 3, to memory only otherwise: Megatron-LM's non-persistent
checkpoint); ``--kill-at N``: rank 1 of the first attempt is SIGKILLed right after saving N.
Each rank writes ``OUT/final_<rank>.pt`` (model and its optimizer shard) and
``OUT/start_<rank>_<attempt>.json`` (the iteration it began at, and from where).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

import torch
import torch.distributed as dist
from megatron_args import stand_in_megatron_training

ARGS = stand_in_megatron_training(
    save="", load="", use_distributed_optimizer=True, finetune=False, consumed_train_samples=0
)

from dlrover.trainer.torch.flash_checkpoint.megatron_dist_ckpt import (  # noqa: E402
    load_checkpoint,
    save_checkpoint,
)

ITERATIONS, DISK_AT = 6, 3


class ShardedAdam:
    """Adam whose state is sharded over the data-parallel ranks (ZeRO-1): gradients are
    averaged, each rank updates its shard of the flat fp32 parameters, the shards are
    all-gathered back into the model."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float) -> None:
        self.params, self.lr, self.t = params, lr, 0
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        world, rank = dist.get_world_size(), dist.get_rank()
        self.shard = -(-flat.numel() // world)
        self.total = flat.numel()
        padded = torch.zeros(self.shard * world)
        padded[: self.total] = flat
        self.main = padded[rank * self.shard : (rank + 1) * self.shard].clone()
        self.exp_avg = torch.zeros_like(self.main)
        self.exp_avg_sq = torch.zeros_like(self.main)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        world, rank = dist.get_world_size(), dist.get_rank()
        grads = torch.zeros(self.shard * world)
        grads[: self.total] = torch.cat([p.grad.reshape(-1) for p in self.params])
        dist.all_reduce(grads)
        g = grads[rank * self.shard : (rank + 1) * self.shard] / world
        self.t += 1
        self.exp_avg.mul_(0.9).add_(g, alpha=0.1)
        self.exp_avg_sq.mul_(0.999).addcmul_(g, g, value=0.001)
        m_hat = self.exp_avg / (1 - 0.9**self.t)
        v_hat = self.exp_avg_sq / (1 - 0.999**self.t)
        self.main.sub_(self.lr * m_hat / (v_hat.sqrt() + 1e-8))
        gathered = [torch.empty_like(self.main) for _ in range(world)]
        dist.all_gather(gathered, self.main)
        flat = torch.cat(gathered)[: self.total]
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "lr": self.lr}  # the parameter state is saved per rank

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t, self.lr = state["t"], state["lr"]

    def get_parameter_state_dp_reshardable(self) -> dict[str, Any]:
        return {"param": self.main, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_parameter_state_from_dp_reshardable(self, state: dict[str, Any]) -> None:
        self.main.copy_(state["param"])
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--kill-at", type=int, default=0)
    opts = parser.parse_args()
    ARGS.save = ARGS.load = os.path.join(opts.out, "ckpt")
    dist.init_process_group("gloo")
    rank, attempt = dist.get_rank(), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))]
    optimizer = ShardedAdam(list(model[0].parameters()), lr=0.01)
    # Data parallel over both ranks; each rank its own tensor and pipeline group (of one).
    world = dist.group.WORLD
    own = [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
    iteration, _ = load_checkpoint(
        model, optimizer, None, checkpointing_context={}, skip_load_to_model_and_opt=False,
        tp_group=own, pp_group=own, dp_cp_group=world, dp_group=world, expt_dp_group=world,
        rng_state_key_prefix="",
    )  # fmt: skip
    from dlrover.trainer.torch.flash_checkpoint.megatron import checkpointer_for

    source = checkpointer_for().last_load_source
    with open(os.path.join(opts.out, f"start_{rank}_{attempt}.json"), "w") as f:
        json.dump({"iteration": iteration, "source": source}, f)
    while iteration < ITERATIONS:
        iteration += 1
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(100 * iteration + rank))
        optimizer.zero_grad()
        model[0](x).square().mean().backward()
        optimizer.step()
        save_checkpoint(
            iteration, model, optimizer, None, 1000.0 * iteration, {},
            non_persistent_ckpt=iteration != DISK_AT, train_data_iterator=None,
            preprocess_common_state_dict_fn=None, tp_group=own, pp_group=own,
            dp_cp_group=world, dp_group=world, expt_dp_group=world, rng_state_key_prefix="",
        )  # fmt: skip
        if iteration == DISK_AT:
            torch.save(optimizer.get_parameter_state_dp_reshardable(),
                       os.path.join(opts.out, f"shard{DISK_AT}_{rank}.pt"))  # fmt: skip
        if iteration == opts.kill_at and attempt == 0 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
    final = {
        "model": model[0].state_dict(),
        "shard": optimizer.get_parameter_state_dp_reshardable(),
    }
    torch.save(final, os.path.join(opts.out, f"final_{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
