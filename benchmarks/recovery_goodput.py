"""Goodput part of benchmarks/recovery.py: a fixed wall-clock job with a worker killed on a schedule.

Goodput = the time spent in steps that count / wall time from launch. The worker checkpoints
every step and resumes after the last one, so a step counts once (its last completion, should
one ever be redone); the restarts, the cold start and the per-step checkpoint are what is lost.
Goodput by work = the steps that count x the time of a steady step (`steady_step_s`) / wall
time: it does not count as useful the part of a step spent compiling (a restarted process's
first step) or training at a shrunk world's speed.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from recovery_common import (
    TRAIN,
    Job,
    base_env,
    dlrover_run_cmd,
    fmt,
    median,
    table,
    torchrun_cmd,
    wait_for,
)


@dataclass
class GoodputResult:
    goodput: float
    steps: int
    kills: int
    recoveries: list[float] = field(default_factory=list)
    cold_start: float | None = None
    """Launch -> first step."""
    note: str = ""
    live: float | None = None
    """The master's own goodput (dlrover_goodput_ratio) read just before the end."""
    work: float = 0.0
    """Goodput by work done: the steps that count times the time of a steady step
    (`steady_step_s`), over wall time. A step's own time also holds what it waited for (a
    restarted process's first step compiles its model; a shrunk world's step trains two ranks'
    data at half the speed), which `goodput` counts as useful; this does not."""


def _has_stepped(job: Job, pid: int) -> bool:
    return any(int(p["pid"]) == pid and p["phase"] == "first_step" for p in job.procs())


def _live_goodput(port: int) -> float | None:
    """dlrover_goodput_ratio from the master's /metrics, or None if it does not answer."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        if family.name == "dlrover_goodput_ratio" and family.samples:
            return float(family.samples[0].value)
    return None


def run_schedule(
    cmd: list[str],
    env: dict[str, str],
    out: Path,
    seconds: float,
    every: float,
    step_time: float,
    metrics_port: int | None = None,
    worker: list[str] | None = None,
    survivors_count: bool = False,
) -> GoodputResult:
    """``worker``: the script and its arguments (default: recovery_train.py with
    ``step_time``); ``survivors_count``: a kill's recovery ends at the first step begun after it
    by any process (the survivors stay in-process), not only by a new one."""
    launched = time.time()
    script = worker or [TRAIN, "--step-time", str(step_time)]
    job = Job.start([*cmd, *script, "--out", str(out)], out, env)
    end = launched + seconds
    kills: list[tuple[float, set[int]]] = []
    note = ""
    try:
        next_kill = launched + every
        while next_kill < end:
            time.sleep(max(0.0, next_kill - time.time()))
            # Kill a worker that has made progress: a group still restarting is not hit again.
            victim = wait_for(
                lambda: (pid := job.pid_of(1)[0]) and _has_stepped(job, pid) and pid,
                max(0.0, end - time.time()),
                0.05,
            )
            if not isinstance(victim, int) or time.time() >= end:
                break
            old = {int(p["pid"]) for p in job.procs()}
            kills.append((time.time(), old))
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                kills.pop()
            next_kill = max(next_kill + every, time.time() + 1.0)
            if job.popen.poll() is not None:
                note = f"launcher exited with {job.popen.returncode}"
                break
        time.sleep(max(0.0, end - time.time()))
        live = _live_goodput(metrics_port) if metrics_port else None
    finally:
        steps = job.steps()
        procs = job.procs()
        job.finish(timeout=15.0)
    last: dict[int, dict[str, float]] = {}
    for s in steps:
        if s["ended"] <= end:
            last[int(s["step"])] = s  # a redone step counts once, by its last completion
    useful = sum(s["ended"] - s["began"] for s in last.values())
    res = GoodputResult(useful / seconds, len(last), len(kills), note=note, live=live)
    # A step may compile after a kill or after a process group is made again (the world
    # re-formed in-process): the first begun after each is not steady.
    starts = [k for k, _ in kills] + [p["t"] for p in procs if p.get("phase") == "process_group"]
    steady = steady_step_s(list(last.values()), starts)
    if steady is not None:
        res.work = len(last) * steady / seconds
    if steps:
        res.cold_start = min(s["ended"] for s in steps) - launched
    for killed_at, old in kills:
        after = [
            s["ended"]
            for s in steps
            if (s["began"] > killed_at if survivors_count else s["ended"] > killed_at)
            and (survivors_count or int(s["pid"]) not in old)
        ]
        if after:
            res.recoveries.append(min(after) - killed_at)
    return res


def steady_step_s(steps: list[dict[str, float]], starts: list[float]) -> float | None:
    """The mean time of a steady step: not a process's first, not the first begun after one
    of ``starts`` (a kill, a process group made again: either may compile), not a shrunk world's (it trains
    two ranks' data), and at most 3x the median; None without such steps."""
    first = {min(s["step"] for s in steps if s["pid"] == pid) for pid in {s["pid"] for s in steps}}
    for start in starts:
        after = [s for s in steps if s["began"] > start]
        if after:
            first.add(min(after, key=lambda s: s["began"])["step"])
    full = max((s.get("world", 0) for s in steps), default=0)
    times = sorted(
        s["ended"] - s["began"]
        for s in steps
        if s["step"] not in first and s.get("world", 0) == full
    )
    if not times:
        return None
    limit = 3 * times[len(times) // 2]
    kept = [t for t in times if t <= limit]
    return sum(kept) / len(kept)


def goodput(seconds: float, every: float, step_time: float, root: Path) -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = ["--standalone", "--nproc-per-node=2", "--max-restarts=1000"]
    runs = [
        (
            "dlrover-run (zygote)",
            dlrover_run_cmd(*common, f"--metrics-port={port}"),
            base_env(),
        ),
        (
            "torchrun, no shared store",
            torchrun_cmd(*common),
            base_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
        ),
    ]
    rows = []
    results = []
    for index, (name, cmd, env) in enumerate(runs):
        res = run_schedule(
            cmd,
            env,
            root / f"goodput-{index}",
            seconds,
            every,
            step_time,
            port if name.startswith("dlrover") else None,
        )
        results.append(res)
        print(
            f"  goodput, {name}: {res.goodput:.1%} ({res.steps} steps, {res.kills} kills)",
            flush=True,
        )
    base = results[-1].goodput
    for (name, _, _), res in zip(runs, results, strict=True):
        rows.append(
            [
                name,
                f"{res.goodput:.1%}",
                "–" if res.live is None else f"{res.live:.1%}",
                f"{res.goodput / base:.2f}" if base else "–",
                str(res.steps),
                fmt(res.cold_start),
                str(res.kills),
                f"{len(res.recoveries)}/{res.kills}",
                fmt(median(res.recoveries)),
                res.note,
            ]
        )
    head = [
        "launcher",
        "goodput",
        "master's live goodput",
        "vs torchrun",
        "steps that count",
        "launch → first step (s)",
        "workers killed",
        "recovered",
        "kill → next step (median s)",
        "notes",
    ]
    title = (
        f"### Goodput: {seconds:.0f} s job, rank 1 SIGKILLed every {every:.0f} s "
        f"(step = {step_time * 1000:.0f} ms of simulated compute + a tiny DDP step)"
    )
    return "\n".join([title, "", table(head, rows)])
