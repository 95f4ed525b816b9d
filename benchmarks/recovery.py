"""Recovery benchmark: dlrover-run vs torchrun after a killed worker, a lost node, and under a schedule.

Run: PYTHONPATH=. python benchmarks/recovery.py [--quick] [--reps N] [--only kill,early,node,goodput]
         [--against REV]
Every launcher runs the same script (benchmarks/recovery_train.py: 2 gloo DDP ranks, one node)
in the same invocation, one after another; the tables give medians and ratios. A worker is
killed from outside by its pid (torchrun sets no DLROVER_* variables, so in-script fault
injection would not be the same fault for both). ``--against REV`` adds, to the worker-kill
tables, dlrover-run of that commit (a git worktree beside this one) run the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from against import checkout
from recovery_common import (
    REPO,
    TRAIN,
    Job,
    base_env,
    dlrover_run_cmd,
    fmt,
    median,
    table,
    torchrun_cmd,
    wait_for,
    zygote_idle,
)


@dataclass(frozen=True)
class Launcher:
    name: str
    cmd: list[str]
    env: dict[str, str]
    dlrover: bool
    zygote: bool
    cwd: Path = REPO


def launchers(max_restarts: int, against: tuple[str, Path] | None = None) -> list[Launcher]:
    common = ["--standalone", "--nproc-per-node=2", f"--max-restarts={max_restarts}"]
    before = []
    if against is not None:
        rev, tree = against
        env = base_env(PYTHONPATH=str(tree))
        cmd = dlrover_run_cmd(*common)
        before = [Launcher(f"dlrover-run (zygote) at {rev}", cmd, env, True, True, tree)]
    return [
        *before,
        Launcher("dlrover-run (zygote)", dlrover_run_cmd(*common), base_env(), True, True),
        Launcher(
            "dlrover-run, metrics off",
            dlrover_run_cmd(*common, "--metrics-port=-1"),
            base_env(),
            True,
            True,
        ),
        Launcher(
            "dlrover-run --no-fast-restart",
            dlrover_run_cmd(*common, "--no-fast-restart"),
            base_env(),
            True,
            False,
        ),
        Launcher("torchrun (defaults)", torchrun_cmd(*common), base_env(), False, False),
        Launcher(
            "torchrun, no shared store",
            torchrun_cmd(*common),
            base_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
            False,
            False,
        ),
    ]


# Worker phases, in the order a restarted worker passes them.
PHASES = ("start", "imported", "process_group", "ddp", "first_step")
# Agent log lines (dlrover) that end each launcher phase after the kill.
AGENT_MARKS = (
    ("detect", ") killed by"),
    ("stop", "restarting workers"),
    ("re-form", ": node rank "),
    ("spawn", "started 2 workers"),
)


@dataclass
class KillResult:
    recovered: bool
    seconds: float | None = None
    restarts: int = 0
    """Restart count of the group that made the first step after the kill."""
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds from the kill to the end of each phase."""
    note: str = ""


def kill_once(
    launcher: Launcher, out: Path, timeout: float, step_time: float, early: bool = False
) -> KillResult:
    """Kill rank 1 once the job made 3 steps: `early` at once (a failure in the job's first
    seconds), otherwise once the zygote is ready and after the same settling time for all."""
    cmd = [*launcher.cmd, TRAIN, "--out", str(out), "--step-time", str(step_time)]
    job = Job.start(cmd, out, launcher.env, launcher.cwd)
    try:
        if not wait_for(lambda: len(job.steps()) >= 3, 90.0):
            return KillResult(False, note="never made 3 steps")
        if not early:
            if launcher.zygote and not wait_for(lambda: zygote_idle(job), 60.0, 0.2):
                return KillResult(False, note="zygote never ready")
            time.sleep(1.0)
        victim, _ = job.pid_of(1)
        old_pids = {int(p["pid"]) for p in job.procs()}
        killed_at = time.time()
        signal_pid(victim, signal.SIGKILL)

        def first_new_step() -> dict[str, float] | None:
            for s in job.steps():
                if s["ended"] > killed_at and int(s["pid"]) not in old_pids:
                    return s
            if job.popen.poll() is not None:
                return {"gone": 1.0}
            return None

        step = wait_for(first_new_step, timeout, 0.02)
        if not isinstance(step, dict) or "gone" in step:
            why = "launcher exited" if isinstance(step, dict) else f"no step within {timeout:.0f}s"
            return KillResult(False, note=why)
        result = KillResult(True, step["ended"] - killed_at)
        new = [p for p in job.procs() if int(p["pid"]) not in old_pids]
        pid0 = int(step["pid"])
        result.restarts = max((int(p["restart"]) for p in new if int(p["pid"]) == pid0), default=0)
        group = [p for p in new if int(p["restart"]) == result.restarts]
        for phase in PHASES[:-1]:
            times = [p["t"] for p in group if p["phase"] == phase]
            if times:
                # "start": the first worker began; later phases: the slowest worker is done.
                at = min(times) if phase == "start" else max(times)
                result.phases[phase] = at - killed_at
        result.phases["first_step"] = result.seconds or 0.0
        if launcher.dlrover:
            for name, needle in AGENT_MARKS:
                logged = job.first_line(needle, killed_at)
                if logged is not None:
                    result.phases[name] = logged - killed_at
        return result
    finally:
        job.finish(timeout=15.0)


def signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def worker_kill(
    reps: int,
    timeout: float,
    step_time: float,
    root: Path,
    early: bool = False,
    against: tuple[str, Path] | None = None,
) -> str:
    results: dict[str, list[KillResult]] = {}
    all_launchers = launchers(3, against)
    what = "early worker kill" if early else "worker kill"
    for rep in range(reps):
        for index, launcher in enumerate(all_launchers):  # interleaved: load drifts, hits all
            out = root / f"{'early' if early else 'kill'}-{rep}-{index}"
            res = kill_once(launcher, out, timeout, step_time, early)
            results.setdefault(launcher.name, []).append(res)
            status = fmt(res.seconds) + " s" if res.recovered else f"FAILED ({res.note})"
            print(f"  {what}, {launcher.name}, rep {rep + 1}/{reps}: {status}", flush=True)
    return render_kill(results, all_launchers, early)


def render_kill(
    results: dict[str, list[KillResult]], all_launchers: list[Launcher], early: bool = False
) -> str:
    best_torchrun = None
    for launcher in all_launchers:
        if not launcher.dlrover:
            m = median([r.seconds for r in results[launcher.name] if r.seconds is not None])
            if m is not None and (best_torchrun is None or m < best_torchrun):
                best_torchrun = m
    rows = []
    for launcher in all_launchers:
        runs = results[launcher.name]
        ok = [r for r in runs if r.recovered]
        secs = [r.seconds for r in ok if r.seconds is not None]
        m = median(secs)
        first = sum(1 for r in ok if r.restarts <= 1)
        ratio = f"{m / best_torchrun:.2f}" if m is not None and best_torchrun else "–"
        spread = f"{min(secs):.2f}–{max(secs):.2f}" if secs else "–"
        rows.append([launcher.name, f"{len(ok)}/{len(runs)}", str(first), fmt(m), spread, ratio])
    head = [
        "launcher",
        "recovered",
        "on 1st restart",
        "kill → first step (median s)",
        "min–max",
        "vs best torchrun",
    ]
    when = "at the job's 3rd step (seconds after launch)" if early else "in steady state"
    out = [f"### Worker kill {when}: SIGKILL of rank 1 → first completed step of the new group", ""]
    out.append(table(head, rows))
    here = median([r.seconds for r in results["dlrover-run (zygote)"] if r.seconds is not None])
    for launcher in all_launchers:
        if launcher.cwd != REPO:  # --against: the same launcher at another commit
            runs = results[launcher.name]
            then = median([r.seconds for r in runs if r.seconds is not None])
            if here is not None and then:
                out += ["", f"dlrover-run (zygote) here vs {launcher.name}: {here / then:.2f}x"]
    # Where the time goes: seconds from the kill to the end of each phase (medians of the runs
    # that recovered); then the same as durations.
    cols = ["detect", "stop", "re-form", "spawn", *PHASES]
    rows = []
    for launcher in all_launchers:
        ok = [r for r in results[launcher.name] if r.recovered]
        row = [launcher.name]
        for col in cols:
            row.append(fmt(median([r.phases[col] for r in ok if col in r.phases])))
        rows.append(row)
    labels = {
        "detect": "worker exit logged",
        "stop": "survivor stopped",
        "re-form": "round formed",
        "spawn": "workers started (agent)",
        "start": "script began",
        "imported": "imports done",
        "process_group": "process group",
        "ddp": "DDP + optimizer + resume",
        "first_step": "first step",
    }
    out += ["", "Seconds from the kill to the end of each phase (medians; – : not logged):", ""]
    out.append(table(["launcher", *[labels[c] for c in cols]], rows))
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one rep, a 60 s goodput job (~3 min)")
    p.add_argument("--reps", type=int, default=None, help="runs per launcher (default 3, quick 1)")
    p.add_argument(
        "--only",
        default="kill,early,node,goodput",
        help="sections to run: kill (steady state), early (kill at the 3rd step), node, goodput, "
        "compiled (a torch.compile'd transformer: restart vs in-process), compiled-goodput "
        "(its goodput with a kill every 60 s over 10 min); the last two not in the default",
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a run may take to recover")
    p.add_argument("--step-time", type=float, default=0.05, help="simulated compute per step (s)")
    p.add_argument("--goodput-seconds", type=float, default=None, help="default 300, quick 60")
    p.add_argument("--kill-every", type=float, default=None, help="default 30, quick 15")
    p.add_argument("--keep", default="", help="keep every run's files (logs) under this directory")
    p.add_argument(
        "--against",
        default="",
        metavar="REV",
        help="also run dlrover-run of this commit (a git worktree) in the worker-kill sections",
    )
    a = p.parse_args()
    reps = a.reps or (1 if a.quick else 3)
    sections = set(a.only.split(","))
    started = time.monotonic()
    parts = []
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="dlrover-recovery-"))
        against = (a.against, stack.enter_context(checkout(a.against))) if a.against else None
        root = Path(a.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        if "kill" in sections:
            parts.append(worker_kill(reps, a.timeout, a.step_time, root, against=against))
            print(f"  ({time.monotonic() - started:.0f} s so far)", flush=True)
        if "early" in sections:
            parts.append(
                worker_kill(reps, a.timeout, a.step_time, root, early=True, against=against)
            )
            print(f"  ({time.monotonic() - started:.0f} s so far)", flush=True)
        if "node" in sections:
            from recovery_nodes import node_loss

            sizes = ["1:2"] if a.quick else ["1:2", "2:2"]
            parts.append(node_loss(reps, a.timeout, a.step_time, root, sizes, not a.quick))
            print(f"  ({time.monotonic() - started:.0f} s so far)", flush=True)
        if "compiled" in sections:
            from recovery_compiled import compiled_kill

            parts.append(compiled_kill(reps, max(a.timeout, 180.0), root))
            print(f"  ({time.monotonic() - started:.0f} s so far)", flush=True)
        if "compiled-goodput" in sections:
            from recovery_compiled import compiled_goodput

            seconds = a.goodput_seconds or (120.0 if a.quick else 600.0)
            every = a.kill_every or (30.0 if a.quick else 60.0)
            parts.append(compiled_goodput(seconds, every, root))
            print(f"  ({time.monotonic() - started:.0f} s so far)", flush=True)
        if "goodput" in sections:
            from recovery_goodput import goodput

            seconds = a.goodput_seconds or (60.0 if a.quick else 300.0)
            every = a.kill_every or (15.0 if a.quick else 30.0)
            parts.append(goodput(seconds, every, a.step_time, root))
    print()
    print("\n\n".join(parts))
    print(f"\n(total {time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
