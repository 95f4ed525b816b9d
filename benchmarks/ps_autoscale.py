"""Benchmark of a TensorFlow parameter-server job submitted without resources and auto-scaled,
against a hand-picked configuration and a bad one.

Run: PYTHONPATH=. python benchmarks/ps_autoscale.py   (needs tensorflow-cpu and cgroups)
Each run submits the Wide & Deep example (`examples/tf_ps/wide_deep.py`: a 4M-row embedding
table, 128 MiB, and 0.05 s of worker time per batch, so that two workers train faster than one)
with `dlrover submit` on the local engine, one after the other:
- (a) hand-picked: 2 ps and 2 workers, 2 GiB each;
- (b) bad: 1 ps and 1 worker, the ps given 450 MiB (too little for its table: OOM-killed and
  relaunched 1.5x bigger until it fits);
- (c) no resources, ``auto_scale``: 1 ps and 1 worker, up to 2 of each (``max_count``),
  sized from measurement after ``--sizing-s`` and scaled by the master's plans every
  ``--interval-s``.
It prints each job's completion time (submit -> the chief's end) and its ratio to (a), and
where it went, from the chief's report: when its script had imported TensorFlow and when its
first shard was done (both from the submit), its `fit` (of which its recoveries' pauses), the
time after `fit` (reading the model back from the ps, the evaluation) and from the chief's
report to the end of `dlrover submit` (the chief's exit, the master's). Then the nodes each
ended with, and for (c) when its last plan was made (the time to its final size).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "tf_ps" / "wide_deep.py"
BUCKETS = 500_000
"""Embedding rows per field: a 4M x 8 table (128 MiB) the ps hold."""


def _roles(kind: str) -> dict[str, Any]:
    big = {"resources": {"memory": "2Gi"}}
    if kind == "good":
        return {"chief": big, "ps": {"count": 2, **big}, "worker": {"count": 2, **big}}
    if kind == "bad":
        return {"chief": big, "ps": {"resources": {"memory": "450Mi"}}, "worker": big}
    return {"ps": {"max_count": 2}, "worker": {"max_count": 2}}


def run(tmp: Path, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """Submit one job and wait for it: its completion time, final nodes and plans."""
    name = f"wd-{kind}"
    out = tmp / name
    spec = {
        "name": name,
        "distribution_strategy": "ParameterServerStrategy",
        "entrypoint": str(EXAMPLE),
        "args": [
            "--out",
            str(out),
            "--size",
            str(args.size),
            "--buckets",
            str(BUCKETS),
            "--step-time",
            str(args.step_time),
        ],  # fmt: skip
        "roles": _roles(kind),
        "auto_scale": kind == "auto",
        "max_relaunches": 5,
    }
    path = tmp / f"{name}.yaml"
    path.write_text(json.dumps(spec))
    home = tmp / f"home-{kind}"
    env = {
        **os.environ,
        "DLROVER_HOME": str(home),
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "DLROVER_AUTOSCALE_SIZING_S": str(args.sizing_s),
        "DLROVER_AUTOSCALE_INTERVAL_S": str(args.interval_s),
        "DLROVER_AUTOSCALE_WINDOW_S": str(args.interval_s),
        "DLROVER_AUTOSCALE_COOLDOWN_S": "0",
    }
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    started, wall = time.monotonic(), time.time()
    done = subprocess.run(
        [sys.executable, "-m", "dlrover.cli.job", "submit", str(path)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=args.timeout_s,
    )
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"job {name} failed: {done.stderr[-3000:]}")
    final = json.loads((home / "jobs" / name / "final.json").read_text())
    report = json.loads((out / "report.json").read_text())
    plans = [(at - wall, text) for at, text in final["plans"]]
    return {
        "seconds": seconds,
        "ps": report["ps"],
        "workers": report["workers"],
        "failures": len(final["failures"]),
        "eval_loss": report["eval_loss"],
        "imported_s": report["imported_at"] - wall,
        "first_shard_s": report["first_shard_at"] - wall,
        "fit_s": report["seconds"],
        "paused_s": sum(r["pause_s"] for r in report["recoveries"]),
        "after_fit_s": report["ended_at"] - report["fit_ended_at"],
        "exit_s": seconds - (report["ended_at"] - wall),
        "final_size_s": plans[-1][0] if plans else 0.0,
        "plans": plans,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=60_000, help="Samples of the dataset.")
    p.add_argument("--step-time", type=float, default=0.05, help="Worker seconds per batch.")
    p.add_argument("--sizing-s", type=float, default=5.0, help="(c)'s measurement for sizing.")
    p.add_argument("--interval-s", type=float, default=2.0, help="(c)'s seconds between plans.")
    p.add_argument("--timeout-s", type=float, default=600.0)
    args = p.parse_args()
    labels = {
        "good": "(a) hand-picked: 2 ps, 2 workers, 2 GiB",
        "bad": "(b) bad: 1 ps (450 MiB), 1 worker",
        "auto": "(c) no resources, auto_scale",
    }
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        for kind in labels:
            results[kind] = run(Path(directory), kind, args)
    base = results["good"]["seconds"]
    print(f"{'run':<38} {'JCT s':>6} {'vs (a)':>6} {'ps':>3} {'workers':>7} {'failures':>8}"
          f" {'final size at s':>15} {'eval loss':>9}")  # fmt: skip
    for kind, label in labels.items():
        r = results[kind]
        at = f"{r['final_size_s']:.1f}" if r["plans"] else "-"
        print(
            f"{label:<38} {r['seconds']:6.1f} {r['seconds'] / base:5.2f}x {r['ps']:>3} "
            f"{r['workers']:>7} {r['failures']:>8} {at:>15} {r['eval_loss']:9.4f}"
        )
    print("\nwhere the time went (s):")
    print(f"{'run':<38} {'imported':>8} {'1st shard':>9} {'fit':>6} {'paused':>6}"
          f" {'after fit':>9} {'exit':>6}")  # fmt: skip
    for kind, label in labels.items():
        r = results[kind]
        print(
            f"{label:<38} {r['imported_s']:8.1f} {r['first_shard_s']:9.1f} {r['fit_s']:6.1f} "
            f"{r['paused_s']:6.1f} {r['after_fit_s']:9.1f} {r['exit_s']:6.1f}"
        )
    print("(c)'s plans:")
    for at, text in results["auto"]["plans"]:
        print(f"  {at:6.1f}s  {text}")


if __name__ == "__main__":
    main()
