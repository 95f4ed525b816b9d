"""Launch-to-first-step time, torchrun --standalone vs dlrover-run --standalone, side by side.

    python benchmarks/startup.py --reps 5

Also reports the resident memory of an idle dlrover-master and of a dlrover-run agent
(workers excluded).
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

import psutil

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "first_step.py")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DLROVER_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("DLROVER_LOG_LEVEL", "WARNING")
    return env


def launch_to_first_step(launcher: list[str], nproc: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "t")
        t0 = time.time()
        r = subprocess.run(
            [*launcher, "--standalone", f"--nproc-per-node={nproc}", WORKER, out],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        if r.returncode != 0:
            raise RuntimeError(f"{launcher} failed: {r.stderr[-2000:]}")
        return float(Path(out).read_text()) - t0


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def idle_master_rss() -> float:
    with tempfile.TemporaryDirectory() as d:
        env_file = os.path.join(d, "m.env")
        p = subprocess.Popen(
            [sys.executable, "-m", "dlrover.cli.master", "--port", "0", "--write-env", env_file],
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 30
            while not os.path.exists(env_file) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)  # let it settle into its idle loop before reading RSS
            return rss_mb(p.pid)
        finally:
            p.kill()
            p.wait()


def agent_rss() -> float:
    """RSS of a dlrover-run (embedded master included) whose single worker just sleeps."""
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "sleep.py")
        Path(script).write_text("import time\ntime.sleep(30)\n")
        p = subprocess.Popen(
            [sys.executable, "-m", "dlrover.cli.run", "--standalone", "--nproc-per-node=1", script],
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            proc = psutil.Process(p.pid)
            deadline = time.monotonic() + 30
            while not proc.children() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.0)
            return rss_mb(p.pid)
        finally:
            p.terminate()
            p.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--nproc", type=int, default=2)
    args = ap.parse_args()
    launchers = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run"],
        "dlrover-run": [sys.executable, "-m", "dlrover.cli.run"],
        # Metrics and dashboard off: what serving them costs the start.
        "dlrover-run --metrics-port -1": [
            sys.executable,
            "-m",
            "dlrover.cli.run",
            "--metrics-port=-1",
        ],
        # No zygote at all: what the zygote (started with the workers) costs the first start.
        "dlrover-run --no-fast-restart": [
            sys.executable,
            "-m",
            "dlrover.cli.run",
            "--no-fast-restart",
        ],
    }
    times: dict[str, list[float]] = {k: [] for k in launchers}
    launch_to_first_step(launchers["dlrover-run"], args.nproc)  # warm the page cache for both
    for i in range(args.reps):
        for name, cmd in launchers.items():  # interleaved so machine noise hits both alike
            times[name].append(launch_to_first_step(cmd, args.nproc))
        print(
            f"rep {i + 1}/{args.reps}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()),
            file=sys.stderr,
        )
    t_med = statistics.median(times["torchrun"])
    d_med = statistics.median(times["dlrover-run"])
    print(f"\nLaunch -> first step, {args.nproc} gloo workers, {args.reps} reps (median, min-max)")
    print("| launcher | median s | min s | max s | ratio vs torchrun |")
    print("|---|---|---|---|---|")
    for name, v in times.items():
        print(
            f"| {name} | {statistics.median(v):.2f} | {min(v):.2f} | {max(v):.2f} | "
            f"{statistics.median(v) / t_med:.2f}x |"
        )
    print(f"\ndlrover-run / torchrun = {d_med / t_med:.2f} (target <= 1.10)")
    n_med = statistics.median(times["dlrover-run --no-fast-restart"])
    print(
        f"workers forked from the zygote / fresh interpreters = {d_med / n_med:.3f} "
        f"(one import of torch per node instead of one per worker; target <= 1.05)"
    )
    print("\nResident memory (workers excluded)")
    print("| process | RSS MB | target |")
    print("|---|---|---|")
    print(f"| idle dlrover-master | {idle_master_rss():.0f} | < 150 |")
    print(f"| dlrover-run agent (with its embedded master) | {agent_rss():.0f} | < 150 |")


if __name__ == "__main__":
    main()
