"""Which of DLRover's source files a worker-SIGKILL restart runs through: master, agents, workers.

Run: PYTHONPATH=. python benchmarks/restart_path.py [--against REV] [--keep DIR]

A 2-node job (a `dlrover-master` and two `dlrover-run --nnodes=2 --nproc-per-node=1` agents,
tests/scripts/flash_train.py: DDP state in flash-checkpoint memory every step, 0.1 s of simulated
compute per step) has rank 1 kill itself at step 30 (DLROVER_FAULTS). Every Python process of the job runs with a profile hook
(a sitecustomize on PYTHONPATH) that stamps the calls of each function of the ``dlrover``
package (each at most once per 50 ms per process). The restart path is every file with a function called for the
restart, in any process, between the kill and the restarted rank's first reported step (see
`restart_path`; module and class bodies run by an import, with their comprehensions, are not
counted, nor is the fault injection that kills the rank); the table also splits it
by process kind, and names what each file was doing. ``--against REV`` counts the same at
another commit (a git worktree), side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from against import checkout
from recovery_common import REPO, base_env, master_cmd, table

FAULT_STEP = 30
"""The step rank 1 is killed at: 3 s of steady training before (STEP_TIME_S each)."""
STEP_TIME_S = 0.1
STEADY_S = 2.5
"""At least this stretch of training before the kill is the steady work a restart is compared
with: longer than the agents' heartbeat interval (2 s), so periodic background work (a
heartbeat and what it samples) is seen there too and not counted for the restart."""

SITECUSTOMIZE = """
import os, sys, threading, time
_DIR = os.environ.get("DLROVER_TRACE_DIR")
if _DIR:
    _seen = set()
    _state = [None, 0.0]
    def _open():
        _seen.clear()
        _state[0] = open(os.path.join(_DIR, f"{os.getpid()}.trace"), "a", buffering=1)
        with open("/proc/self/cmdline", "rb") as f:  # sys.argv is not set yet at site time
            argv = f.read().replace(b"\\0", b" ").decode(errors="replace")
        _state[0].write(f"{time.time():.6f} argv {argv[:200]}\\n")
    def _hook(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if not code.co_flags & 1:  # a module or class body (an import): not a function
            return
        caller = frame.f_back
        if code.co_name.startswith("<") and caller is not None and not caller.f_code.co_flags & 1:
            return  # a comprehension of a module or class body: part of the import
        name = code.co_filename
        i = name.rfind("/dlrover/")
        if i < 0:
            return
        now = time.time()
        if now - _state[1] > 0.05:  # each function at most once per 50 ms per process
            _seen.clear()
            _state[1] = now
        if code in _seen:
            return
        _seen.add(code)
        _state[0].write(f"{now:.6f} {name[i + 1:]} {code.co_name}\\n")
    _open()
    os.register_at_fork(after_in_child=_open)
    sys.setprofile(_hook)
    threading.setprofile(_hook)
"""


def run_job(tree: Path, work: Path) -> Path:
    """Run the job from ``tree`` once under the tracer; returns the trace directory."""
    traces = work / "traces"
    site = work / "site"
    traces.mkdir(parents=True)
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = base_env(PYTHONPATH=f"{site}{os.pathsep}{tree}", DLROVER_TRACE_DIR=str(traces))
    env["DLROVER_LOG_LEVEL"] = "WARNING"
    env_file = work / "master.env"
    logs = open(work / "job.log", "w")  # noqa: SIM115
    master = subprocess.Popen(
        master_cmd(env_file, work / "state.db"),
        cwd=tree,
        env=env,
        stdout=logs,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while not env_file.exists():
            if master.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the master did not start: {(work / 'job.log').read_text()}")
            time.sleep(0.05)
        for line in env_file.read_text().splitlines():
            key, _, value = line.partition("=")
            env[key] = value
        env["DLROVER_FAULTS"] = f"kill:rank=1:step={FAULT_STEP}"
        script = tree / "tests" / "scripts" / "flash_train.py"
        agents = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dlrover.cli.run",
                    "--nnodes=2",
                    "--nproc-per-node=1",
                    f"--node-rank={rank}",
                    "--max-restarts=2",
                    str(script),
                    "--steps",
                    str(FAULT_STEP + 6),
                    "--ckpt",
                    str(work / "ckpt"),
                    "--out",
                    str(work / "out"),
                    "--disk-every",
                    "100",
                    "--step-time",
                    str(STEP_TIME_S),
                ],
                cwd=tree,
                env=env,
                stdout=logs,
                stderr=subprocess.STDOUT,
            )
            for rank in range(2)
        ]
        try:
            for agent in agents:
                if agent.wait(300) != 0:
                    raise RuntimeError(f"the job failed: {(work / 'job.log').read_text()[-3000:]}")
        finally:
            for agent in agents:  # SIGTERM: an agent stops its workers on the way out
                if agent.poll() is None:
                    agent.terminate()
                    agent.wait(30)
    finally:
        master.kill()
        master.wait(10)
        logs.close()
    return traces


def restart_path(traces: Path) -> tuple[dict[str, set[str]], float]:
    """File -> the process kinds that ran it for the restart; and how long the restart took.

    The restart runs between the kill and the restarted rank's first reported step. In a
    process started after the kill (the restarted worker) everything it runs is the restart's;
    in one that lived through it (agents, master, the other worker) only what it did not do in
    as long a stretch of training just before the kill (heartbeats, step reports and the
    other background work go on with or without a restart)."""
    calls: list[tuple[float, int, str, str]] = []
    kinds: dict[int, str] = {}
    for path in traces.glob("*.trace"):
        pid = int(path.stem)
        for line in path.read_text().splitlines():
            stamp, what, rest = line.split(" ", 2)
            if what == "argv":
                kinds[pid] = _kind(rest)
            else:
                calls.append((float(stamp), pid, what, rest))
    calls.sort()
    killed = next(at for at, _, f, fn in calls if f.endswith("testing/faults.py") and fn == "_fire")
    first: dict[int, float] = {}
    for at, pid, _, _ in calls:
        first.setdefault(pid, at)
    reported = min(
        at
        for at, pid, f, fn in calls
        if at > killed
        and first[pid] > killed
        and f.endswith("trainer/progress.py")
        and fn == "report"
    )
    took = reported - killed
    stretch = max(took, STEADY_S)
    steady = {(pid, f, fn) for at, pid, f, fn in calls if killed - stretch <= at < killed}
    files: dict[str, set[str]] = defaultdict(set)
    for at, pid, f, fn in calls:
        if not killed <= at <= reported or f.startswith(("dlrover/testing/", "dlrover/faults/")):
            continue  # the job's fault injection and test helpers are not the restart's
        if first[pid] <= killed and (pid, f, fn) in steady:
            continue
        files[f].add(kinds.get(pid, "worker"))
    return dict(files), took


def _kind(argv: str) -> str:
    if "dlrover.cli.master" in argv:
        return "master"
    if "dlrover.cli.run" in argv:
        return "agent"
    return "worker"  # the zygote and the workers forked from it


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", help="also count at this git revision (a worktree)")
    p.add_argument("--keep", help="keep the traces under this directory")
    a = p.parse_args()
    trees: list[tuple[str, Path]] = [("this tree", REPO)]
    with contextlib.ExitStack() as stack:
        if a.against:
            trees.append((a.against, stack.enter_context(checkout(a.against))))
        base = Path(a.keep) if a.keep else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        results = []
        for name, tree in trees:
            print(f"running the job at {name} under the tracer...", file=sys.stderr, flush=True)
            traces = run_job(tree, base / name.replace(" ", "-").replace("/", "-"))
            results.append((name, *restart_path(traces)))
    rows = []
    for name, files, took in results:
        by_kind: dict[str, int] = defaultdict(int)
        for kinds in files.values():
            for kind in kinds:
                by_kind[kind] += 1
        rows.append(
            [
                name,
                str(len(files)),
                str(by_kind["agent"]),
                str(by_kind["master"]),
                str(by_kind["worker"]),
                f"{took:.2f}",
            ]
        )
    header = ["tree", "files", "agent", "master", "worker", "kill -> first step (s, traced)"]
    print(table(header, rows))
    for name, files, _ in results:
        print(f"\n{name}: the restart path's files")
        for f in sorted(files):
            print(f"  {f}  ({', '.join(sorted(files[f]))})")


if __name__ == "__main__":
    main()
