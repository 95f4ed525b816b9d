"""Data-parallel steps (an all-reduce each) where, once (until the file ``--once`` exists), rank
``--rank`` skips the all-reduce of step ``--step`` and blocks in its own code: the other ranks
wait in that all-reduce for ever (a hang whose laggard is that rank). Restarted, it trains to
the end."""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from dlrover.trainer import StepReporter


def wait_for_something_that_never_comes() -> None:
    time.sleep(3600)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--step", type=int, default=5)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--once", required=True)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    progress = StepReporter()
    for step in range(1, a.steps + 1):
        if rank == a.rank and step == a.step and not os.path.exists(a.once):
            open(a.once, "w").close()
            wait_for_something_that_never_comes()
        t = torch.ones(4)
        dist.all_reduce(t)
        assert t[0].item() == dist.get_world_size()
        time.sleep(0.05)
        progress.report(step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
