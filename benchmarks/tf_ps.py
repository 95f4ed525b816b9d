"""Benchmark of a TensorFlow parameter-server job losing a ps: DLRover's in-place recovery
against the restart way.

Run: PYTHONPATH=. python benchmarks/tf_ps.py [--rounds 2]   (needs tensorflow-cpu)
Each round submits the Wide & Deep example (1 chief, 2 ps, 2 workers on the local engine) and
SIGKILLs ps 1 after 5 of 20 shards, then measures the time from the kill until the chief
schedules training again:
- in place: the master relaunches the ps on its address, the chief rebuilds in its process and
  restores the latest checkpoint (what `dlrover submit` does);
- the restart way: the job is stopped and submitted again on the same checkpoint directory
  (every process starts over: imports, servers, the strategy), what a job without in-place
  recovery does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "tf_ps" / "wide_deep.py"


class Job:
    """`dlrover submit` of the example with its own DLROVER_HOME, output and checkpoints."""

    def __init__(self, home: Path, out: Path, name: str) -> None:
        spec = {
            "name": name,
            "distribution_strategy": "ParameterServerStrategy",
            "entrypoint": str(EXAMPLE),
            "args": ["--out", str(out), "--shard-delay", "0.3"],
            "roles": {"ps": {"count": 2}, "worker": {"count": 2}},
        }
        path = out.parent / f"{name}.yaml"
        path.write_text(json.dumps(spec))
        env = {**os.environ, "DLROVER_HOME": str(home), "TF_CPP_MIN_LOG_LEVEL": "3"}
        env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
        self.home, self.out, self.name = home, out, name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dlrover.cli.job", "submit", str(path)],
            env=env,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def lines(self) -> list[str]:
        path = self.out / "progress"
        return path.read_text().splitlines() if path.exists() else []

    def wait_lines(self, count: int, timeout_s: float = 120) -> float:
        """When the progress file reached ``count`` lines (polled every 10 ms)."""
        deadline = time.monotonic() + timeout_s
        while len(self.lines()) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {self.name}: no progress line {count} in {timeout_s}s")
            time.sleep(0.01)
        return time.monotonic()

    def kill_ps(self) -> float:
        pid_file = self.home / "jobs" / self.name / "nodes" / f"{self.name}-ps-1-0" / "pid"
        os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
        return time.monotonic()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the master stops and removes every node
        self.proc.wait(60)


def in_place(tmp: Path, index: int) -> float:
    job = Job(tmp / f"home-a{index}", tmp / f"a{index}", f"inplace{index}")
    try:
        job.wait_lines(5)
        killed = job.kill_ps()
        before = len(job.lines())
        while True:  # the first line written after the recovery counts 1 recovery
            resumed = job.wait_lines(before + 1)
            last = job.lines()[-1].split()
            if int(last[2]) >= 1:
                return resumed - killed
            before += 1
    finally:
        job.stop()


def restart(tmp: Path, index: int) -> float:
    out = tmp / f"b{index}"
    job = Job(tmp / f"home-b{index}", out, f"restart{index}")
    try:
        job.wait_lines(5)
        killed = job.kill_ps()
        job.stop()
    finally:
        job.stop()
    before = len(Job.lines(job))
    again = Job(tmp / f"home-b{index}", out, f"restart{index}")
    try:
        # The first shard the new chief schedules (it restored the latest checkpoint first).
        return again.wait_lines(before + 1) - killed
    finally:
        again.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    results: dict[str, list[float]] = {"in place": [], "restart the job": []}
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        for index in range(args.rounds):
            results["in place"].append(in_place(tmp, index))
            results["restart the job"].append(restart(tmp, index))
    base = statistics.median(results["in place"])
    print(f"{'a ps SIGKILLed: kill -> training again':<40} {'median s':>9} {'runs':>18} ratio")
    for what, times in results.items():
        runs = " ".join(f"{t:.2f}" for t in times)
        ratio = statistics.median(times) / base
        print(f"{what:<40} {statistics.median(times):9.2f} {runs:>18} {ratio:5.1f}x")


if __name__ == "__main__":
    main()
