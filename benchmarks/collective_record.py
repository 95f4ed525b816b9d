"""What recording every collective costs: PyTorch's flight recorder, which dlrover-run turns on
(TORCH_FR_BUFFER_SIZE=2000) so that a hang names the rank the others wait for.

Run: python benchmarks/collective_record.py [--steps 400] [--reps 3]

Two gloo ranks train a small DDP model (many small all-reduces per second: the recorder's worst
case relative to the step) with the recorder off (0) and on (2000), interleaved ABAB. Printed:
wall seconds per step and CPU-seconds per step of both ranks together (what 2 cores cannot
separate in wall time, they show in CPU time), and the ratio on/off.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

WORKER = r"""
import json, sys, time
import torch, torch.distributed as dist
from torch import nn
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]), bucket_cap_mb=0.01
)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(16, 64)
steps = int(sys.argv[1])
for _ in range(20):  # warm-up
    model(x).sum().backward(); opt.step(); opt.zero_grad()
dist.barrier()
t0, c0 = time.perf_counter(), time.process_time()
for _ in range(steps):
    model(x).sum().backward(); opt.step(); opt.zero_grad()
dist.barrier()
wall, cpu = time.perf_counter() - t0, time.process_time() - c0
with open(sys.argv[2] + f".{dist.get_rank()}", "w") as f:
    json.dump({"wall": wall / steps, "cpu": cpu / steps}, f)
dist.destroy_process_group()
"""


def run(buffer: str, steps: int, out: str) -> tuple[float, float]:
    """One 2-rank run; (wall s/step of rank 0, CPU-s/step of both ranks)."""
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": buffer, "OMP_NUM_THREADS": "1"}
    script = os.path.join(os.path.dirname(out), "worker.py")
    with open(script, "w") as f:
        f.write(WORKER)
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         script, str(steps), out],
        env=env, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    docs = []
    for rank in (0, 1):
        with open(f"{out}.{rank}") as f:
            docs.append(json.load(f))
    return docs[0]["wall"], sum(d["cpu"] for d in docs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    results: dict[str, list[tuple[float, float]]] = {"0": [], "2000": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            for buffer in ("0", "2000") if rep % 2 == 0 else ("2000", "0"):
                results[buffer].append(run(buffer, a.steps, os.path.join(tmp, f"r{rep}{buffer}")))
                time.sleep(0.1)
    off_wall = statistics.median(w for w, _ in results["0"])
    on_wall = statistics.median(w for w, _ in results["2000"])
    off_cpu = statistics.median(c for _, c in results["0"])
    on_cpu = statistics.median(c for _, c in results["2000"])
    print(f"DDP, 2 gloo ranks, 8 buckets per step, {a.steps} steps x {a.reps} reps (medians)\n")
    print("| flight recorder | wall ms/step | CPU ms/step (both ranks) |")
    print("|---|---|---|")
    print(f"| off (0) | {off_wall * 1e3:.2f} | {off_cpu * 1e3:.2f} |")
    print(f"| on (2000, dlrover-run's default) | {on_wall * 1e3:.2f} | {on_cpu * 1e3:.2f} |")
    print(f"| on / off | {on_wall / off_wall:.3f}x | {on_cpu / off_cpu:.3f}x |")


if __name__ == "__main__":
    main()
