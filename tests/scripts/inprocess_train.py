"""A compiled transformer trained with DDP inside `dlrover.trainer.torch.inprocess.Wrapper`.

The oracle job of in-process recovery: rank r's batch at step s depends only on (s, r), every
step is flash-checkpointed to memory, so any run that resumes from its checkpoints ends with
the same parameters bit for bit as a run without failures (2 ranks: DDP's all-reduce of two
summands is exact whatever its buckets). The model, optimizer and compiled graphs are built
once per process, outside the wrapped function; each entry of the function initialises the
process group of the round, wraps the model in DDP and loads the newest checkpoint.

Every entry appends ``<rank> <pid> <first step> <loaded from> <recoveries> <time>`` to
<out>.entries, and after its first step ``<rank> <pid> <seconds> <graphs compiled>`` to
<out>.first (graphs inductor compiled from scratch: its caches' misses);
rank 0 appends each completed step (its time, the world size) to <out>.steps and the final
SHA-256 to <out>.final.
With ``--shrink`` a node goes on without a failed local rank, taking its batch (`data_share`):
the loss scale (1/2 with 2 ranks) keeps the gradients bit for bit those of the full world.
Faults come from DLROVER_FAULTS (read at each entry: the restart count changes in-process).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dlrover.testing.digest import tensors_digest
from dlrover.testing.faults import FaultInjector
from dlrover.trainer import StepReporter
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType
from dlrover.trainer.torch.inprocess import Wrapper, data_share, recoveries

VOCAB, DIM, SEQ = 64, 32, 16


class TinyTransformer(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, 4, 2 * DIM, dropout=0.0, batch_first=True)
        self.body: nn.Module = (  # no layers: embedding and head alone (the quickest compile)
            nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            if layers
            else nn.Identity()
        )
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))


def append(path: str, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def compiled_graphs() -> int:
    """Graphs inductor compiled from scratch in this process (those its caches did not hold)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_miss"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--compile", default="aot_eager", help="torch.compile backend, or none")
    p.add_argument("--step-time", type=float, default=0.0, help="simulated compute per step")
    p.add_argument("--shrink", action="store_true", help="go on without a failed local rank")
    p.add_argument("--replica-count", type=int, default=0, help="DdpCheckpointer replica_count")
    p.add_argument(
        "--hold-shrunk-at",
        type=int,
        default=0,
        help="at the end of this step in a shrunk world, wait (reporting it) for the replacement",
    )
    a = p.parse_args()

    FaultInjector.from_env().maybe_inject(0)  # step 0: as the process starts (a replacement too)
    torch.manual_seed(0)
    model = TinyTransformer(a.layers)
    net = model if a.compile == "none" else torch.compile(model, backend=a.compile)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ckpt = DdpCheckpointer(a.ckpt, replica_count=a.replica_count)
    progress = StepReporter()

    def loss_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        target = tokens.roll(1, 1).reshape(-1)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target)

    def warmup() -> None:  # a replacement compiles before it joins: the training loss's graphs
        tokens = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(0))
        loss_of(net(tokens), tokens).backward()
        opt.zero_grad(set_to_none=True)

    @Wrapper(shrink=a.shrink, warmup=warmup)
    def train() -> None:
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        ddp = DistributedDataParallel(net)
        state = ckpt.load_checkpoint()
        start = 1
        if state:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            start = int(state["step"]) + 1
        entered = time.time()
        append(
            a.out + ".entries",
            f"{rank} {os.getpid()} {start} {ckpt.last_load_source} {recoveries()} {entered:.6f}",
        )
        faults = FaultInjector.from_env()
        for step in range(start, a.steps + 1):
            faults.maybe_inject(step)
            share = data_share()  # its own rank's batch, and a failed local rank's meanwhile
            opt.zero_grad()
            for i, data_rank in enumerate(share.ranks):
                g = torch.Generator().manual_seed(step * 1000 + data_rank)
                tokens = torch.randint(0, VOCAB, (4, SEQ), generator=g)
                last_micro = i == len(share.ranks) - 1
                with contextlib.nullcontext() if last_micro else ddp.no_sync():
                    (loss_of(ddp(tokens), tokens) * share.scale).backward()
            opt.step()
            if a.step_time:
                time.sleep(a.step_time)
            last = step == a.steps
            ckpt.save_checkpoint(
                step,
                {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                storage_type=StorageType.DISK if last else StorageType.MEMORY,
            )
            if rank == 0:
                append(a.out + ".steps", f"{step} {time.time():.6f} {dist.get_world_size()}")
            if step == start:  # each rank's first step of this entry (its compile, if any)
                seconds, compiled = time.time() - entered, compiled_graphs()
                append(a.out + ".first", f"{rank} {os.getpid()} {seconds:.3f} {compiled}")
            progress.report(step)  # where a request to leave at a step's end takes effect
            if step == a.hold_shrunk_at and len(share.ranks) > 1:
                hold = time.monotonic() + 120
                while time.monotonic() < hold:  # the replacement joins at a step's end: here
                    time.sleep(0.01)
                    progress.report(step)
                raise RuntimeError(f"held at step {step} for 120 s: no replacement joined")
        ckpt.wait_latest_checkpoint(60)
        if rank == 0:
            with open(a.out + ".final", "w") as f:
                f.write(tensors_digest(model.state_dict().values()))
        dist.destroy_process_group()

    train()


if __name__ == "__main__":
    main()
