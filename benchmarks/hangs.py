"""Hang detection, side by side: how soon each kind of real hang is caught, how many healthy but
slow phases are wrongly called hung, and what watching costs per step.

Run: cd benchmarks && PYTHONPATH=.. python hangs.py [--floor 3] [--give-up 30] [--only KIND]

Launchers, each on the same unchanged torchrun DDP scripts (2 gloo ranks on this machine):

- ``dlrover-run`` with learned timeouts (``--hang-timeout min=FLOOR``: the steps take ~0.05 s, so
  the learned step timeout is the floor; at the defaults the floor is 60 s and every figure
  below scales with it);
- ``dlrover-run --hang-timeout FLOOR``: the same number, fixed (the former opt-in);
- ``torchrun``, which has no hang detection: a hung job is killed after ``--give-up`` seconds.

``hangs``: `tests/scripts/hang_kinds.py` with each kind (a rank SIGSTOPped, a rank that skips a
collective then blocks, a dead-locked data-loader worker, a Python loop that never ends, a rank
that exits with 0 mid-training): seconds from the hang's start (the file the rank writes as it
hangs) to the verdict, and whether the job then ended with the failure-free model.

``healthy``: `tests/scripts/slow_but_healthy.py` scaled to the floor (a first step, an unmarked
evaluation on rank 0 and a marked checkpoint, each 4 x the floor, and a restart mid-job): how
many hang verdicts each launcher gave (each one a false kill and a restart).

``cost``: what the agent's watching adds per optimizer step in the worker (the beat: torch's
global optimizer hook, one pwrite), measured in process over many steps of a small model; the
flight recorder's cost per step is `collective_record.py`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import psutil
from recovery_common import REPO, base_env, dlrover_run_cmd, fmt, table, torchrun_cmd

SCRIPTS = REPO / "tests" / "scripts"
KINDS = ("sigstop", "skip", "dataloader", "loop", "exit")
_VERDICT = re.compile(r"(\d\d:\d\d:\d\d\.\d+) ERROR dlrover\.agent\.monitor: hang: rank \d+: ")


def _seconds_of_day(stamp: datetime) -> float:
    return stamp.hour * 3600 + stamp.minute * 60 + stamp.second + stamp.microsecond / 1e6


def launchers(floor: float) -> dict[str, list[str]]:
    common = ["--nproc-per-node=2", "--max-restarts=2"]
    return {
        "dlrover-run, learned": dlrover_run_cmd(
            "--standalone", *common, "--hang-timeout", f"min={floor:g}"
        ),
        f"dlrover-run, fixed {floor:g} s": dlrover_run_cmd(
            "--standalone", *common, "--hang-timeout", f"{floor:g}"
        ),
        "torchrun": torchrun_cmd("--standalone", "--nproc-per-node=2", "--max-restarts=2"),
    }


def run(cmd: list[str], give_up: float) -> tuple[int | None, str]:
    """(exit code or None when killed at ``give_up``, the output)."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=base_env(), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            code: int | None = proc.wait(timeout=give_up)
        except subprocess.TimeoutExpired:
            code = None
            kill_tree(proc.pid)
            proc.wait(timeout=30)
        out.seek(0)
        return code, out.read()


def kill_tree(pid: int) -> None:
    """SIGKILL a launcher and every process under it (torchrun's workers leave its session, and
    a stopped one is continued so that it dies), then reap what is ours."""
    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return
    for process in tree:
        with contextlib.suppress(psutil.Error):
            process.kill()
            process.resume()
    psutil.wait_procs(tree, timeout=30)


def hangs(floor: float, give_up: float, kinds: list[str]) -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ok_model = None
        for name, cmd in launchers(floor).items():
            row = [name]
            for kind in ["none", *kinds]:
                work = Path(tmp) / f"{len(rows)}-{kind}"
                work.mkdir()
                once = work / "once"
                script = [
                    str(SCRIPTS / "hang_kinds.py"), "--kind", kind, "--once", str(once),
                    "--out", str(work / "out"),
                ]  # fmt: skip
                code, log = run([*cmd, *script], give_up + 60 if kind == "none" else give_up)
                outs = [work / "out.0", work / "out.1"]
                model = outs[0].read_text() if all(p.exists() for p in outs) else None
                if kind == "none":
                    ok_model = ok_model or model
                    continue
                verdicts = _VERDICT.findall(log)
                if verdicts and once.exists():
                    started = datetime.fromtimestamp(once.stat().st_mtime)
                    seen = datetime.strptime(verdicts[0], "%H:%M:%S.%f")
                    caught = f"{_seconds_of_day(seen) - _seconds_of_day(started):.1f} s"
                elif code is None:
                    caught = f"never (killed at {give_up:g} s)"
                else:
                    caught = f"no verdict (exit {code})"
                good = "yes" if code == 0 and model is not None and model == ok_model else "no"
                row.append(f"{caught}; model {good}")
                print(f"  {name} / {kind}: {row[-1]}", flush=True)
            rows.append(row)
    print(f"\nreal hangs (floor {floor:g} s): time from the hang to its verdict; the job then "
          "ended with the failure-free model?")  # fmt: skip
    print(table(["launcher", *kinds], rows))


def healthy(floor: float) -> None:
    scale = [
        "--first-step-s", f"{4 * floor:g}", "--eval-s", f"{4 * floor:g}",
        "--persist-s", f"{4 * floor:g}",
    ]  # fmt: skip
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, cmd in launchers(floor).items():
            work = Path(tmp) / str(len(rows))
            work.mkdir()
            started = time.monotonic()
            script = [str(SCRIPTS / "slow_but_healthy.py"), "--out", str(work / "out"), *scale]
            code, log = run([*cmd, *script], 600)
            wall = time.monotonic() - started
            false_kills = len(_VERDICT.findall(log))
            restarts = (
                (work / "out.1.restarts").read_text() if (work / "out.1.restarts").exists() else "?"
            )
            rows.append([name, str(false_kills), restarts, "–" if code is None else str(code),
                         f"{wall:.0f}"])  # fmt: skip
            print(f"  {name}: {rows[-1]}", flush=True)
    print(f"\nhealthy but slow (each slow phase 4 x the floor {floor:g} s, one kill mid-job):")
    print(table(["launcher", "hang verdicts (false)", "restarts", "exit", "wall s"], rows))


BEAT_WORKER = r"""
import os, sys, time, torch
from dlrover.trainer.progress import watch_optimizer_steps
if sys.argv[1] == "on":
    os.environ["DLROVER_STEP_FILE"] = sys.argv[2]
    watch_optimizer_steps()
import torch.optim
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
model(torch.ones(2, 8)).sum().backward()
for _ in range(2000):
    opt.step()
n = int(sys.argv[3])
t0 = time.perf_counter()
for _ in range(n):
    opt.step()
print((time.perf_counter() - t0) / n * 1e6)
"""


def cost(reps: int = 5, steps: int = 200_000) -> None:
    results: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(reps):
            for mode in ("off", "on"):
                out = subprocess.run(
                    [sys.executable, "-c", BEAT_WORKER, mode, f"{tmp}/step", str(steps)],
                    env=base_env(), capture_output=True, text=True, check=True,
                )  # fmt: skip
                results[mode].append(float(out.stdout.split()[-1]))
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    print(f"\nwatching's cost per optimizer step (SGD on a Linear(8, 8), medians of {reps}):")
    print(table(["", "us per optimizer.step()", "added"],
                [["without the beat", fmt(off), "–"], ["with the beat", fmt(on), fmt(on - off)]]))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--floor", type=float, default=3.0)
    p.add_argument("--give-up", type=float, default=30.0)
    p.add_argument("--only", choices=["hangs", "healthy", "cost"])
    p.add_argument("--kinds", default=",".join(KINDS))
    a = p.parse_args()
    if a.only in (None, "cost"):
        cost()
    if a.only in (None, "hangs"):
        hangs(a.floor, a.give_up, a.kinds.split(","))
    if a.only in (None, "healthy"):
        healthy(a.floor)


if __name__ == "__main__":
    main()
