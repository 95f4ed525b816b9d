"""A plain torchrun DDP script whose phases are slow but healthy, each as jobs have them:

- a first step far slower than the others (``--first-step-s`` of work, as a compile is);
- an evaluation on rank 0 alone, unmarked, for ``--eval-s`` (the model's forward over and over,
  no step), while the other ranks first save, marked as a checkpoint (`dlrover.trainer.section`),
  writing slowly for ``--persist-s``, then wait for rank 0 in a barrier;
- rank 1 killed once at step ``--kill-step`` (a restart in the middle of the job).

Each rank writes its final weights' sum to ``--out``.<rank> and its restart count to
``--out``.<rank>.restarts.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist

from dlrover.trainer import section


def compile_like(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(i * i for i in range(2000))


def evaluate(model: torch.nn.Module, seconds: float) -> float:
    total, end = 0.0, time.monotonic() + seconds
    with torch.no_grad():
        while time.monotonic() < end:
            total += float(model(torch.randn(256, 64)).sum())
    return total


def persist(path: str, seconds: float) -> None:
    end = time.monotonic() + seconds
    with open(path, "wb") as f:
        while time.monotonic() < end:
            f.write(os.urandom(1 << 16))
            f.flush()
            os.fsync(f.fileno())
            time.sleep(0.2)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--first-step-s", type=float, default=4.0)
    p.add_argument("--eval-s", type=float, default=80.0)
    p.add_argument("--persist-s", type=float, default=20.0)
    p.add_argument("--kill-step", type=int, default=45)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(f"{a.out}.{rank}.restarts", "w") as f:
        f.write(str(restarts))
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.001)
    for step in range(1, a.steps + 1):
        if step == 1:
            compile_like(a.first_step_s)
        loss = model(torch.ones(8, 64) * (step % 5)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(0.05)
        if step == 20 and restarts == 0:
            if rank == 0:
                evaluate(model.module, a.eval_s)
            else:  # meanwhile, then waits in the barrier for rank 0
                with section("checkpoint"):
                    persist(f"{a.out}.ckpt", a.persist_s)
            dist.barrier()
        if step == a.kill_step and rank == 1 and restarts == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    weights = sum(float(t.sum()) for t in model.parameters())
    with open(f"{a.out}.{rank}", "w") as f:
        f.write(f"{weights:.6f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
