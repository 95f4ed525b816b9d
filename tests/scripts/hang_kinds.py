"""A plain torchrun DDP script (no step reports, no DLRover import) in which, once (until the
file ``--once`` exists), rank ``--rank`` hangs at step ``--step`` in one of the ways jobs hang:

- ``sigstop``: the process is stopped (SIGSTOP), as by a debugger or a frozen machine;
- ``skip``: it skips the all-reduce of a metric that the other ranks wait in, and blocks in its
  own code;
- ``dataloader``: its data-loader worker dead-locks, so its main thread waits for data for ever;
- ``loop``: it spins in a Python loop that never ends;
- ``exit``: it exits with 0 in the middle of training, without an error (its connections held
  open by a child for 20 s, as a lingering data-loader worker holds them).

Restarted, it trains to the end and writes its final weights' sum to ``--out``.<rank>.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset


class Numbers(Dataset[torch.Tensor]):
    def __init__(self, stall_at: int) -> None:
        self.stall_at = stall_at

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, i: int) -> torch.Tensor:
        if i == self.stall_at:
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()  # a lock taken twice: dead-locked for ever
        return torch.full((8,), float(i % 7))


def spin() -> None:
    n = 0
    while True:
        n += 1


def wait_for_a_reply_that_never_comes() -> None:
    time.sleep(3600)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kind", required=True)
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--step", type=int, default=15)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--once", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    hang_now = not os.path.exists(a.once) and rank == a.rank
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = 4
    stall_at = a.step * batch if hang_now and a.kind == "dataloader" else -1
    loader = DataLoader(Numbers(stall_at), batch_size=batch, num_workers=1)
    for step, x in enumerate(loader, start=1):
        if step > a.steps:
            break
        if hang_now and step == a.step:
            open(a.once, "w").close()
            if a.kind == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif a.kind == "loop":
                spin()
            elif a.kind == "exit":
                sys.stdout.flush()
                # The others wait, not fail, because something of this rank still holds its
                # connections open: its data-loader worker does, until its 5 s watchdog sees
                # the rank gone, and then the others' reads fail ("Connection reset by peer"),
                # a race with the hang's 3 s bound on a busy machine (one CI run lost it). A
                # child holding them 20 s, as a lingering worker would, takes the race away.
                if os.fork() == 0:
                    time.sleep(20)
                    os._exit(0)
                os._exit(0)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        metric = loss.detach().clone()
        if hang_now and step == a.step and a.kind == "skip":
            open(a.once, "w").close()
            wait_for_a_reply_that_never_comes()
        dist.all_reduce(metric)
        time.sleep(0.05)
    weights = sum(float(t.sum()) for t in model.parameters())
    with open(f"{a.out}.{rank}", "w") as f:
        f.write(f"{weights:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
