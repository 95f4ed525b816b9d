"""Recovery of a realistic job: a torch.compile'd transformer, one worker SIGKILLed.

Part of benchmarks/recovery.py (``--only compiled``). Every launcher runs
benchmarks/recovery_train_compiled.py (2 gloo DDP ranks on one node, a 4-layer transformer
compiled by inductor, AdamW, a checkpoint every step), with one inductor cache shared by every
run and warmed by a first job (the warm-cache case; a replacement on a fresh machine pays the
cold compile on top). Per failure it measures, from the SIGKILL of rank 1:

- the survivors' next step: when rank 0 (the survivor, or its restarted successor) completes
  the first step it began after the kill, and what was lost: that time less one ordinary step;
- the replacement's first step: when the new rank-1 process completes its first step;
- whether rank 0 kept its process.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from recovery_common import (
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

TRAIN = str(Path(__file__).resolve().with_name("recovery_train_compiled.py"))


@dataclass(frozen=True)
class Setup:
    name: str
    dlrover: bool
    mode: str
    ckpt: str
    env: tuple[tuple[str, str], ...] = ()


SETUPS = (
    # Without the shared store: torchrun's default re-uses the agent's TCPStore across restarts
    # and, killed every 40 s, its workers failed to connect after the second restart and the
    # job stopped training for good (the recovery goodput's torchrun runs the same way).
    Setup("torchrun, no shared store (restart all, torch.save)", False, "plain", "torch"),
    Setup("dlrover-run, restart in place (flash)", True, "plain", "flash"),
    # The same without the zygote's compiler warm-up: what a restart cost before it.
    Setup(
        "dlrover-run, restart in place, DLROVER_ZYGOTE_WARM_COMPILER=0",
        True,
        "plain",
        "flash",
        (("DLROVER_ZYGOTE_WARM_COMPILER", "0"),),
    ),
    Setup("dlrover-run, in-process (Wrapper)", True, "wrapped", "flash"),
    Setup("dlrover-run, in-process shrink (Wrapper(shrink=True))", True, "shrink", "flash"),
)


@dataclass
class Failure:
    survivors_next_s: float | None = None
    lost_s: float | None = None
    replacement_first_s: float | None = None
    kept_process: bool = False
    note: str = ""


def _cmd(setup: Setup, max_restarts: int = 3) -> list[str]:
    common = ["--standalone", "--nproc-per-node=2", f"--max-restarts={max_restarts}"]
    return dlrover_run_cmd(*common) if setup.dlrover else torchrun_cmd(*common)


def _env(setup: Setup, cache: Path) -> dict[str, str]:
    shared = {} if setup.dlrover else {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return base_env(TORCHINDUCTOR_CACHE_DIR=str(cache), **shared, **dict(setup.env))


def run_once(setup: Setup, out: Path, cache: Path, timeout: float, kill: bool = True) -> Failure:
    """One job: reach steady state, kill rank 1, measure, end the job."""
    env = _env(setup, cache)
    cmd = [*_cmd(setup), TRAIN, "--out", str(out), "--mode", setup.mode, "--ckpt", setup.ckpt]
    job = Job.start(cmd, out, env)
    try:
        if not wait_for(lambda: len(job.steps()) >= 10, timeout, 0.05):
            return Failure(note="never made 10 steps")
        if not kill:
            return Failure()
        if setup.dlrover and not wait_for(lambda: zygote_idle(job), 60.0, 0.2):
            return Failure(note="zygote never ready")
        time.sleep(1.0)
        before = job.steps()
        step_s = median([s["ended"] - s["began"] for s in before[-5:]]) or 0.0
        survivor, _ = job.pid_of(0)
        victim, _ = job.pid_of(1)
        old = {int(p["pid"]) for p in job.procs()}
        killed_at = time.time()
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            return Failure(note="rank 1 already gone")

        def next_step() -> dict[str, float] | None:
            # Begun after the kill: the step in flight may still end on the survivor.
            return next((s for s in job.steps() if s["began"] > killed_at), None)

        def replacement_step() -> dict[str, float] | None:
            return next(
                (
                    p
                    for p in job.procs()
                    if p["phase"] == "first_step" and p["rank"] == 1 and int(p["pid"]) not in old
                ),
                None,
            )

        nxt = wait_for(next_step, timeout, 0.01)
        first = wait_for(replacement_step, timeout, 0.02)
        result = Failure()
        if isinstance(nxt, dict):
            result.survivors_next_s = nxt["ended"] - killed_at
            result.lost_s = max(0.0, result.survivors_next_s - step_s)
            result.kept_process = int(nxt["pid"]) == survivor
        if isinstance(first, dict):
            result.replacement_first_s = first["t"] - killed_at
        if nxt is None or first is None:
            result.note = (
                f"no {'next step' if nxt is None else 'replacement step'} in {timeout:.0f}s"
            )
        return result
    finally:
        job.finish(timeout=20.0)


def compiled_kill(reps: int, timeout: float, root: Path) -> str:
    """The section's table: medians over ``reps`` kills per setup, interleaved."""
    cache = root / "inductor-cache"
    started = time.monotonic()
    run_once(SETUPS[1], root / "warmup", cache, 600.0, kill=False)  # fills the cache
    print(f"  compiled job: cache warmed in {time.monotonic() - started:.0f} s", flush=True)
    results: dict[str, list[Failure]] = {s.name: [] for s in SETUPS}
    for rep in range(reps):
        for index, setup in enumerate(SETUPS):
            res = run_once(setup, root / f"compiled-{rep}-{index}", cache, timeout)
            results[setup.name].append(res)
            print(
                f"  compiled job, {setup.name}, rep {rep + 1}/{reps}: next step "
                f"{fmt(res.survivors_next_s)} s, replacement {fmt(res.replacement_first_s)} s "
                f"{res.note}",
                flush=True,
            )
    torchrun = median(
        [r.survivors_next_s for r in results[SETUPS[0].name] if r.survivors_next_s is not None]
    )
    rows = []
    for setup in SETUPS:
        runs = results[setup.name]
        nxt = median([r.survivors_next_s for r in runs if r.survivors_next_s is not None])
        lost = median([r.lost_s for r in runs if r.lost_s is not None])
        first = median([r.replacement_first_s for r in runs if r.replacement_first_s is not None])
        ratio = f"{nxt / torchrun:.2f}" if nxt is not None and torchrun else "–"
        kept = f"{sum(r.kept_process for r in runs)}/{len(runs)}"
        rows.append([setup.name, fmt(nxt), fmt(lost), ratio, fmt(first), kept])
    head = [
        "launcher",
        "survivors' next step (median s)",
        "survivors lost (s)",
        "vs torchrun",
        "replacement's first step (s)",
        "rank 0 kept its process",
    ]
    title = (
        "### Compiled transformer (inductor, warm cache): SIGKILL of rank 1, seconds from the kill"
    )
    return "\n".join([title, "", table(head, rows)])


def compiled_goodput(seconds: float, every: float, root: Path) -> str:
    """Goodput of the compiled job over ``seconds`` with rank 1 SIGKILLed every ``every``
    seconds, per setup (the inductor cache warmed first)."""
    from recovery_goodput import run_schedule

    cache = root / "inductor-cache"
    if not cache.exists():
        run_once(SETUPS[1], root / "goodput-warmup", cache, 600.0, kill=False)
    rows = []
    results = []
    for index, setup in enumerate(SETUPS):
        env = _env(setup, cache)
        cmd = _cmd(setup, max_restarts=1000)
        worker = [TRAIN, "--mode", setup.mode, "--ckpt", setup.ckpt]
        res = run_schedule(
            cmd,
            env,
            root / f"compiled-goodput-{index}",
            seconds,
            every,
            0.0,
            worker=worker,
            survivors_count=True,
        )
        results.append(res)
        print(
            f"  compiled goodput, {setup.name}: {res.goodput:.1%}, by work {res.work:.1%} "
            f"({res.steps} steps, {res.kills} kills)",
            flush=True,
        )
    base = results[0].goodput
    for setup, res in zip(SETUPS, results, strict=True):
        rows.append(
            [
                setup.name,
                f"{res.goodput:.1%}",
                f"{res.work:.1%}",
                f"{res.goodput / base:.2f}" if base else "–",
                str(res.steps),
                str(res.kills),
                fmt(median(res.recoveries)),
                res.note,
            ]
        )
    head = [
        "launcher",
        "goodput",
        "goodput by work",
        "vs torchrun",
        "steps that count",
        "workers killed",
        "kill → next step (median s)",
        "notes",
    ]
    title = (
        f"### Goodput of the compiled transformer: {seconds:.0f} s, rank 1 SIGKILLed every "
        f"{every:.0f} s (a step's time counts once, the last time it completed; by work: the "
        "steps that count x a steady step's time)"
    )
    return "\n".join([title, "", table(head, rows)])
