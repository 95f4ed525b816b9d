"""The realistic worker of benchmarks/recovery_compiled.py: a torch.compile'd transformer under DDP.

Run under dlrover-run or torchrun: ``recovery_train_compiled.py --out DIR --mode M --ckpt C``.
It keeps the file contract of recovery_train.py (DIR/proc.jsonl phases, DIR/pid.<rank>, rank 0's
DIR/steps.jsonl, DIR/stop_at) so the benchmark measures it the same way.

- ``--mode plain``: a torchrun script: after a failure every rank starts again, rebuilds and
  recompiles the model and loads the checkpoint. ``wrapped``: the same loop inside
  `dlrover.trainer.torch.inprocess.Wrapper` (survivors stay in their processes and wait for the
  replacement); ``shrink``: ``Wrapper(shrink=True)`` (they go on at once on the failed rank's
  data; the replacement joins at the end of a step once it has compiled).
- ``--ckpt torch``: ``torch.save`` of rank 0 every step (what a torchrun script does);
  ``flash``: `DdpCheckpointer` into shared memory every step.
"""

from __future__ import annotations

import time

T_START = time.time()  # before any import: the moment the script itself began

import argparse  # noqa: E402
import contextlib  # noqa: E402
import os  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from recovery_train import announce, append_line, stop_step  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from dlrover.trainer import StepReporter  # noqa: E402
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType  # noqa: E402
from dlrover.trainer.torch.inprocess import Wrapper, data_share  # noqa: E402

T_IMPORTED = time.time()
VOCAB, DIM, SEQ, BATCH = 256, 128, 64, 8


class Transformer(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        layer = nn.TransformerEncoderLayer(DIM, 4, 4 * DIM, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(tokens)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--mode", choices=("plain", "wrapped", "shrink"), default="plain")
    p.add_argument("--ckpt", choices=("torch", "flash"), default="torch")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--backend", default="inductor", help="torch.compile backend")
    a = p.parse_args()

    proc_log, me = announce(a.out, T_START, T_IMPORTED)

    torch.manual_seed(0)
    model = Transformer(a.layers)
    net = torch.compile(model, backend=a.backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    flash = DdpCheckpointer(os.path.join(a.out, "flash")) if a.ckpt == "flash" else None
    saved = os.path.join(a.out, "ckpt.pt")
    reporter = StepReporter()
    steps_log = os.path.join(a.out, "steps.jsonl")
    stop_file = os.path.join(a.out, "stop_at")

    def batch(step: int, data_rank: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(step * 1000 + data_rank)
        return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)

    def loss_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens.roll(1, 1).reshape(-1))

    def warmup() -> None:
        # A replacement compiles before it joins the others: one forward and backward with the
        # loss it trains with (another loss, .sum(), gives the backward another gradient's
        # strides: a second graph, compiled again at the first real step).
        tokens = batch(0, 0)
        loss_of(net(tokens), tokens).backward()
        opt.zero_grad(set_to_none=True)

    def train() -> None:
        dist.init_process_group("gloo")
        now_rank, world = dist.get_rank(), dist.get_world_size()
        append_line(proc_log, {**me, "phase": "process_group", "t": time.time(), "world": world})
        ddp = DistributedDataParallel(net)
        start = 1
        if flash is not None:
            state = flash.load_checkpoint()
            if state:
                model.load_state_dict(state["model"])
                opt.load_state_dict(state["optimizer"])
                start = int(state["step"]) + 1
        elif os.path.exists(saved):
            state = torch.load(saved, weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            start = int(state["step"]) + 1
        append_line(proc_log, {**me, "phase": "ddp", "t": time.time()})
        first = True
        step = start
        while stop_step(stop_file) >= step:
            began = time.time()
            share = data_share()
            opt.zero_grad()
            for i, data_rank in enumerate(share.ranks):
                last = i == len(share.ranks) - 1
                with contextlib.nullcontext() if last else ddp.no_sync():
                    tokens = batch(step, data_rank)
                    (loss_of(ddp(tokens), tokens) * share.scale).backward()
            opt.step()
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
            if flash is not None:
                flash.save_checkpoint(step, state, storage_type=StorageType.MEMORY)
            elif now_rank == 0:
                torch.save(state, f"{saved}.tmp")
                os.replace(f"{saved}.tmp", saved)
            ended = time.time()
            if first:
                append_line(proc_log, {**me, "phase": "first_step", "t": ended, "step": step})
                first = False
            if now_rank == 0:
                row = {"step": step, "began": began, "ended": ended, "pid": os.getpid()}
                append_line(steps_log, {**row, "world": world})
            reporter.report(step)
            step += 1
        dist.destroy_process_group()

    run: Callable[[], None] = train
    if a.mode != "plain":
        run = Wrapper(shrink=a.mode == "shrink", warmup=warmup)(train)
    run()
    # gloo threads sometimes abort a torch 2.13 interpreter at exit after the work is done.
    os._exit(0)


if __name__ == "__main__":
    main()
