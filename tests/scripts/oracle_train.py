"""Deterministic DDP training that checkpoints every k steps and resumes: the consistency oracle.

Rank r's batch at step s depends only on (s, r), so any run at the same world size that resumes
from its checkpoints ends with the same parameters bit for bit as a run without failures.
Gradients are averaged with one all_reduce per parameter instead of DDP: DDP re-buckets its
gradients after the first iteration of every process, so a resumed run would sum some elements
in another order than an uninterrupted one and differ in the last bits.
Faults come from DLROVER_FAULTS (dlrover.testing.faults). Rank 0 appends every completed step
to <out>.steps, then saves it, and writes the final parameters' SHA-256 to <out>.final. A run
that resumes drops the logged steps its checkpoint does not hold (stopped between the line and
the save, they are trained again), so the log names each step once.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from dlrover.testing.digest import tensors_digest
from dlrover.testing.faults import FaultInjector
from dlrover.trainer import StepReporter


def forget_steps_after(log: str, saved: int) -> None:
    """Keep the lines of ``log`` up to step ``saved`` (replaced whole: a test may be reading)."""
    if not os.path.exists(log):
        return
    with open(log) as f:
        lines = f.read().splitlines(keepends=True)
    kept = [line for line in lines if line.split() and int(line.split()[0]) <= saved]
    if len(kept) < len(lines):
        with open(log + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(log + ".tmp", log)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1000 + rank)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--every", type=int, default=1, help="checkpoint every k steps")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--step-time", type=float, default=0.0, help="simulated compute per step (s)")
    p.add_argument(
        "--compute-ms",
        type=float,
        default=0.0,
        help="CPU work per step: spin until this many ms of the process's CPU time passed (a "
        "slow fault's throttling stretches it; a --step-time sleep it does not)",
    )
    p.add_argument(
        "--linger-from-rank",
        type=int,
        default=-1,
        help="ranks from this one on take --linger-s more to exit after training (so one node "
        "waits at the exit barrier while the other is still finishing)",
    )
    p.add_argument("--linger-s", type=float, default=0.0)
    p.add_argument(
        "--hold-mib", type=int, default=0, help="memory each worker holds while it trains (MiB)"
    )
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    start = 1
    path = os.path.join(a.ckpt, "ckpt.pt")
    if os.path.exists(path):
        state = torch.load(path, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"]) + 1
    if rank == 0:
        forget_steps_after(a.out + ".steps", start - 1)
    for t in model.state_dict().values():
        dist.broadcast(t, 0)
    held = bytearray(a.hold_mib << 20)
    held[::4096] = b"\x01" * len(held[::4096])  # touched: it counts against a memory limit
    faults = FaultInjector.from_env()
    progress = StepReporter()
    for step in range(start, a.steps + 1):
        began = time.monotonic()
        faults.maybe_inject(step)
        if a.step_time:
            time.sleep(a.step_time)  # simulated compute, so membership changes land mid-run
        if a.compute_ms:
            spin_until = time.process_time() + a.compute_ms / 1000
            while time.process_time() < spin_until:
                pass
        x, y = batch(step, rank)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        busy = time.monotonic() - began  # this rank's own work, before waiting for the others
        for param in model.parameters():
            assert param.grad is not None
            dist.all_reduce(param.grad)
            param.grad /= world
        opt.step()
        progress.report(step, busy, samples=len(x))
        if rank == 0:
            with open(a.out + ".steps", "a") as f:
                f.write(f"{step} {world} {loss.item():.6f}\n")
            if step % a.every == 0 or step == a.steps:
                tmp = path + ".tmp"
                torch.save(
                    {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp
                )
                os.replace(tmp, path)
        dist.barrier()  # nobody runs ahead of the checkpoint it may have to resume from
    if rank == 0:
        with open(a.out + ".final", "w") as f:
            f.write(tensors_digest(model.state_dict().values()))
    dist.destroy_process_group()
    if 0 <= a.linger_from_rank <= rank:
        time.sleep(a.linger_s)  # a slow teardown, after every collective


if __name__ == "__main__":
    main()
