"""The worker of benchmarks/recovery.py: a small gloo DDP job that timestamps every phase and step.

Run under dlrover-run or torchrun: ``recovery_train.py --out DIR [--steps N] [--step-time S]``.
Each process appends one JSON line to DIR/proc.jsonl at each phase (start of the script, after
the imports, after init_process_group, after DDP + optimizer, after its first step) and rewrites
DIR/pid.<rank> (its pid, and its agent's pid under dlrover) so the benchmark can kill it from
outside: torchrun sets no DLROVER_* variables, so an external SIGKILL is the fair fault for both.
Rank 0 appends every completed step to DIR/steps.jsonl and checkpoints every step to DIR/ckpt.pt;
a restarted group resumes after the last checkpoint, so no completed step is redone. The benchmark ends a run cleanly by
writing a step number (a little ahead of the current one) to DIR/stop_at.
"""

from __future__ import annotations

import time

T_START = time.time()  # before any import: the moment the script itself began

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from dlrover.trainer import StepReporter  # noqa: E402

T_IMPORTED = time.time()


def append_line(path: str, record: dict[str, object]) -> None:
    # One write of one line with O_APPEND: lines from several processes never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def stop_step(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):
        return 1 << 62


def announce(out: str, started: float, imported: float) -> tuple[str, dict[str, object]]:
    """Write this process's pid file and its first two phases; (proc.jsonl's path, the fields
    every line of this process carries)."""
    rank = int(os.environ["RANK"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    agent = os.environ.get("DLROVER_AGENT_PID", "")
    write_atomic(os.path.join(out, f"pid.{rank}"), f"{os.getpid()} {agent}\n")
    proc_log = os.path.join(out, "proc.jsonl")
    me: dict[str, object] = {"rank": rank, "pid": os.getpid(), "restart": restart}
    append_line(proc_log, {**me, "phase": "start", "t": started})
    append_line(proc_log, {**me, "phase": "imported", "t": imported})
    return proc_log, me


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="directory for the timestamp files")
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--step-time", type=float, default=0.05, help="simulated compute per step (s)")
    a = p.parse_args()

    rank = int(os.environ["RANK"])
    proc_log, me = announce(a.out, T_START, T_IMPORTED)

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    append_line(proc_log, {**me, "phase": "process_group", "t": time.time(), "world": world})

    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ckpt = os.path.join(a.out, "ckpt.pt")
    start = 1
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"]) + 1
    append_line(proc_log, {**me, "phase": "ddp", "t": time.time()})

    reporter = StepReporter()
    steps_log = os.path.join(a.out, "steps.jsonl")
    stop_file = os.path.join(a.out, "stop_at")
    for step in range(start, a.steps + 1):
        if stop_step(stop_file) < step:
            break  # the benchmark set a step a little ahead: every rank stops at the same one
        began = time.time()
        if a.step_time:
            time.sleep(a.step_time)  # simulated compute that leaves the 2 cores to the launchers
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(64, 32, generator=g)
        loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ended = time.time()
        reporter.report(step)
        if step == start:
            append_line(proc_log, {**me, "phase": "first_step", "t": ended})
        if rank == 0:
            tmp = f"{ckpt}.tmp"
            torch.save(
                {"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": step},
                tmp,
            )
            os.replace(tmp, ckpt)
            append_line(
                steps_log,
                {"step": step, "began": began, "ended": ended, "pid": os.getpid(), "world": world},
            )
    dist.destroy_process_group()
    # gloo threads sometimes abort a torch 2.13 interpreter at exit after the work is done.
    os._exit(0)


if __name__ == "__main__":
    main()
