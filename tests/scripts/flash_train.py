"""Deterministic training with DdpCheckpointer: memory every step, storage every k steps.

After a failure the restarted workers must resume from the newest step in the agent's shared
memory (not the older one on storage), so the final parameters equal a failure-free run's.
Rank 0 appends "<step> <loaded-from>" lines to <out>.steps and the final SHA-256 to <out>.final;
every rank appends "<rank> <first step> <loaded-from> <peer node or -1>" to <out>.loads.
Every save must return True (none is skipped, even while a persist runs); ``--busy`` keeps a
side thread spinning in each trainer, as a data loader keeps the cores busy.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch
import torch.distributed as dist
from torch import nn

from dlrover.testing.digest import tensors_digest
from dlrover.testing.faults import FaultInjector
from dlrover.trainer import StepReporter
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType


def _spin() -> None:
    while True:
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--disk-every", type=int, default=5)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--step-time", type=float, default=0.0, help="simulated compute per step")
    p.add_argument("--replica-count", type=int, default=0, help="DdpCheckpointer replica_count")
    p.add_argument("--busy", action="store_true", help="spin a side thread (saturate the CPU)")
    p.add_argument("--no-wait", action="store_true", help="never wait for a persist")
    a = p.parse_args()
    if a.busy:
        threading.Thread(target=_spin, daemon=True).start()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ckpt = DdpCheckpointer(a.ckpt, replica_count=a.replica_count)
    state = ckpt.load_checkpoint()
    start = 1
    if state:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"]) + 1
    for t in model.state_dict().values():
        dist.broadcast(t, 0)
    if rank == 0:
        with open(a.out + ".steps", "a") as f:
            f.write(f"resume {start} {ckpt.last_load_source}\n")
    peer = ckpt.restored_from_peer
    with open(a.out + ".loads", "a") as f:
        f.write(f"{rank} {start} {ckpt.last_load_source} {-1 if peer is None else peer}\n")
    faults, progress = FaultInjector.from_env(), StepReporter()
    for step in range(start, a.steps + 1):
        faults.maybe_inject(step)
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(16, 8, generator=g)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        for param in model.parameters():  # fixed-order averaging, see oracle_train.py
            assert param.grad is not None
            dist.all_reduce(param.grad)
            param.grad /= world
        opt.step()
        if a.step_time:
            time.sleep(a.step_time)  # simulated compute, so that failures land mid-run
        storage = StorageType.DISK if step % a.disk_every == 0 else StorageType.MEMORY
        saving = time.monotonic()
        saved = ckpt.save_checkpoint(
            step,
            {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
            storage_type=storage,
        )
        assert saved is True, f"the {storage.value} save of step {step} returned {saved!r}"
        if storage == StorageType.DISK and not a.no_wait:
            # Storage holds the step before training goes on: the failure tests count on
            # which step is on storage when they strike.
            ckpt.wait_latest_checkpoint(60)
        progress.report(step, checkpoint_s=time.monotonic() - saving, samples=len(x))
        if rank == 0:
            with open(a.out + ".steps", "a") as f:
                f.write(f"{step}\n")
        dist.barrier()
    ckpt.wait_latest_checkpoint(60)
    if rank == 0:
        with open(a.out + ".final", "w") as f:
            f.write(tensors_digest(model.state_dict().values()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
