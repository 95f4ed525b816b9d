"""A fresh process's first compiled step, with and without the zygote's compiler warm-up.

Each run is a new Python process that imports torch (as a zygote-forked worker has), optionally
runs `dlrover.agent.compiler_warmup.warm_compiler()` (what the zygote does once, before it forks
the workers of a compiling job), then compiles a 2-layer ``TransformerEncoder`` with AdamW and
times its first step, in CPU-seconds of the process and its children (inductor's probes run
subprocesses) and in wall seconds. The inductor cache is warmed by a first run, so the figures
are the warm-cache case of a restarted worker. The peer is the same process without the
warm-up: what a worker started by torchrun (or forked from a zygote that did not warm) pays.

    PYTHONPATH=.. python compiler_warmup.py [--reps 3]

Run it from a worktree of another commit (``PYTHONPATH=<worktree>``) to compare warm-ups.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def one_run(warm: bool) -> dict[str, float]:
    """In this (fresh) process: the first compiled step's CPU and wall seconds."""
    import torch

    if warm:
        from dlrover.agent.compiler_warmup import warm_compiler

        result = warm_compiler()
        if result.skipped:
            print(f"the warm-up skipped: {', '.join(result.skipped)}", file=sys.stderr)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    cpu, wall = _cpu_s(), time.perf_counter()
    compiled = torch.compile(model)
    compiled(torch.randn(8, 16, 64)).sum().backward()
    optimizer.step()
    return {"cpu_s": _cpu_s() - cpu, "wall_s": time.perf_counter() - wall}


def _spawn(warm: bool) -> dict[str, float]:
    mode = "warm" if warm else "cold"
    out = subprocess.run(
        [sys.executable, __file__, "--one", mode], capture_output=True, text=True, timeout=600
    )
    if out.returncode != 0:
        raise SystemExit(f"the {mode} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3, help="runs of each kind (default 3)")
    parser.add_argument("--one", choices=["cold", "warm"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one == "warm")))
        return
    print("warming the inductor cache (a first run) ...", file=sys.stderr, flush=True)
    _spawn(False)
    runs: dict[bool, list[dict[str, float]]] = {False: [], True: []}
    for rep in range(args.reps):
        for warm in (False, True):
            runs[warm].append(_spawn(warm))
            got = runs[warm][-1]
            print(
                f"  rep {rep + 1}/{args.reps}, {'warmed' if warm else 'not warmed'}: "
                f"{got['cpu_s']:.2f} CPU-s, {got['wall_s']:.2f} s",
                file=sys.stderr,
                flush=True,
            )
    cold_cpu = statistics.median(r["cpu_s"] for r in runs[False])
    print(f"\nfirst compiled step of a fresh process, warm inductor cache, medians of {args.reps}")
    print(f"(torch {__import__('torch').__version__}, {os.cpu_count()} CPUs)\n")
    print("| process | CPU-s | wall s | CPU vs not warmed |")
    print("|---|---|---|---|")
    for warm, name in ((False, "not warmed (torchrun's worker)"), (True, "forked after warm-up")):
        cpu = statistics.median(r["cpu_s"] for r in runs[warm])
        wall = statistics.median(r["wall_s"] for r in runs[warm])
        print(f"| {name} | {cpu:.2f} | {wall:.2f} | {cpu / cold_cpu:.2f}x |")


if __name__ == "__main__":
    main()
