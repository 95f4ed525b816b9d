"""Data-parallel steps where rank ``--rank`` raises at ``--step`` on every attempt, and its
teardown lingers: its connections close at once (the others' collectives break), but the
process stays ``--linger`` seconds (a teardown joining threads), so its agent sees its exit
after the other nodes' agents saw their collateral errors."""

from __future__ import annotations

import argparse
import atexit
import gc
import os
import time

import torch
import torch.distributed as dist

from dlrover.trainer import StepReporter


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--step", type=int, default=6)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--linger", type=float, default=3.0)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    progress = StepReporter()
    for step in range(1, a.steps + 1):
        if rank == a.rank and step == a.step:
            dist.destroy_process_group()  # its connections close: the peers' collectives break
            gc.collect()
            atexit.register(time.sleep, a.linger)  # ... and this process ends later
            raise ValueError(
                f"bad batch at step {step} (restart {os.environ['TORCHELASTIC_RESTART_COUNT']})"
            )
        t = torch.ones(4)
        dist.all_reduce(t)
        time.sleep(0.05)
        progress.report(step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
