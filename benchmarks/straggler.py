"""Straggler benchmark: a job with one 3x slow node, kept (static) vs excluded by the node check.

Run: PYTHONPATH=. python benchmarks/straggler.py [--steps 60] [--step-time 0.2] [--reps 1]

Each row is a real `dlrover submit` of 3 nodes x 1 worker on the local engine, training the
deterministic DDP oracle (tests/scripts/oracle_train.py: one allreduce per parameter each step,
``--step-time`` seconds of CPU work, `--compute-ms`). The slow node is node slot 1 with
``DLROVER_FAULTS=slow:node=1:factor=3``: its agent holds its worker to 1/3 of a CPU
(dlrover/faults/throttle.py) so its steps take 3x as long, and so does its node-check compute test; its replacement (a new machine) is healthy. Rows:

- healthy: no slow node (the floor), and the same with --node-check (what the check costs);
- static: the slow node stays, every step waits for it (what a job without a check gets);
- --exclude-straggler alone: runtime scores name the slow node after 3 low reports (reports
  every ``--report-s`` seconds here instead of 60) and it is replaced mid-training;
- --node-check --exclude-straggler: the check names the slow node before training, it is
  replaced, the job trains on healthy nodes.

Job completion time is from `submit` to its exit; the ratio column is static / row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ORACLE = REPO / "tests" / "scripts" / "oracle_train.py"


def run_job(
    name: str, steps: int, step_time: float, faults: str, flags: list[str], report_s: float
) -> float:
    """Seconds from `dlrover submit` to its exit (0 required)."""
    with tempfile.TemporaryDirectory(prefix="dlrover-straggler-") as tmp:
        ckpt = Path(tmp) / "ckpt"
        ckpt.mkdir()
        env = {
            k: v for k, v in os.environ.items() if not k.startswith(("DLROVER_", "TORCHELASTIC_"))
        }
        env.update(
            DLROVER_HOME=str(Path(tmp) / "home"),
            DLROVER_FAULTS=faults,
            DLROVER_STRAGGLER_REPORT_S=str(report_s),
        )
        env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
        cmd = [
            sys.executable, "-m", "dlrover.cli.job", "submit", "--name", name, "--nnodes", "3",
            "--nproc-per-node", "1", *flags, str(ORACLE), "--steps", str(steps),
            "--compute-ms", str(step_time * 1000), "--ckpt", str(ckpt), "--out", str(Path(tmp) / "out"),
        ]  # fmt: skip
        start = time.monotonic()
        r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
        elapsed = time.monotonic() - start
        if r.returncode != 0:
            raise SystemExit(f"{name} failed ({r.returncode}):\n{r.stderr[-3000:]}")
        return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-time", type=float, default=0.2)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--report-s", type=float, default=3.0, help="runtime straggler report period")
    a = p.parse_args()
    slow = "slow:node=1:factor=3"
    rows = [
        ("healthy (no slow node)", "", []),
        ("healthy, --node-check", "", ["--node-check"]),
        ("static: slow node kept", slow, []),
        ("--exclude-straggler (runtime scores)", slow, ["--exclude-straggler"]),
        ("--node-check --exclude-straggler", slow, ["--node-check", "--exclude-straggler"]),
    ]
    times: dict[str, float] = {}
    for label, faults, flags in rows:
        samples = [
            run_job(f"straggler-{i}", a.steps, a.step_time, faults, flags, a.report_s)
            for i in range(a.reps)
        ]
        times[label] = statistics.median(samples)
        print(f"  {label}: {', '.join(f'{s:.1f}s' for s in samples)}", file=sys.stderr, flush=True)
    static = times["static: slow node kept"]
    print(f"\n3 nodes x 1 worker, {a.steps} steps of {a.step_time}s, node 1 is 3x slow, runtime "
          f"reports every {a.report_s:g}s (median of {a.reps})\n")  # fmt: skip
    print(f"| {'job':<38} | {'completion s':>12} | {'static / this':>13} |")
    print(f"|{'-' * 40}|{'-' * 13}:|{'-' * 14}:|")
    for label, _, _ in rows:
        print(f"| {label:<38} | {times[label]:>12.1f} | {static / times[label]:>12.2f}x |")


if __name__ == "__main__":
    main()
