"""Auto-scaling benchmark: (a) a job given too little memory, (b) a job that may grow.

Run: PYTHONPATH=. python benchmarks/autoscale.py [--part a|b|both]

(a) **Under-provisioned memory.** One node, one worker that holds ``--hold-mib`` MiB while it
    trains (tests/scripts/oracle_train.py), given ``--memory-mib`` (less than it needs):
    - torchrun in a cgroup with that memory limit (as a container of that size would run it):
      the worker is OOM-killed, torchrun restarts it in the same cgroup ``--max-restarts``
      times, and the job fails;
    - `dlrover submit --memory <that>`: the local engine's cgroup OOM-kills the node, the master
      relaunches it with 1.5x memory until it fits, and the job completes from its checkpoint.
    Needs a writable cgroup (v1 memory controller or v2): root in a VM or container.

(b) **Scaling out.** examples/train_elastic.py, a fixed global batch whose per-sample work
    (``--sample-time``, an accelerator's time per sample) splits over the workers, so each node
    added speeds a step up. Fixed at 1 node, fixed at 3 nodes, and ``--nnodes 1:3 --auto-scale``
    (plans every 2 s, cooldown 5 s): job completion time and, for the auto-scaled job, the time
    from submit until it trains at 3 nodes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dlrover.engines.base import Resources
from dlrover.engines.cgroups import CgroupRoot, NodeCgroup, join_cgroup

REPO = Path(__file__).resolve().parent.parent
ORACLE = REPO / "tests" / "scripts" / "oracle_train.py"
ELASTIC = REPO / "examples" / "train_elastic.py"


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DLROVER_", "TORCHELASTIC_"))}
    env.update(DLROVER_HOME=str(home), **extra)
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def _timed(
    cmd: list[str],
    env: dict[str, str],
    marks: dict[str, str],
    timeout: float,
    preexec: Callable[[], object] | None = None,
) -> tuple[int, float, dict[str, float], str]:
    """Run ``cmd``; returns exit code, seconds, and for each name in ``marks`` the seconds until
    a stderr line first matched its pattern."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=preexec,
    )  # fmt: skip
    seen: dict[str, float] = {}
    lines: list[str] = []

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            for name, pattern in marks.items():
                if name not in seen and re.search(pattern, line):
                    seen[name] = time.monotonic() - start

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    elapsed = time.monotonic() - start
    reader.join(timeout=10)
    return code, elapsed, seen, "".join(lines)


# --- (a) ---------------------------------------------------------------------------------------
def _memory_cgroup(limit_mib: int) -> NodeCgroup | None:
    """A new cgroup with a memory limit (v1 memory controller or v2), or None."""
    root, why = CgroupRoot.detect()
    if root is None:
        print(f"(a) skipped: {why}")
        return None
    return root.create(f"bench-torchrun-{os.getpid()}", Resources(memory_mib=limit_mib))


def part_a(memory_mib: int, hold_mib: int, steps: int) -> None:
    cgroup = _memory_cgroup(memory_mib)
    if cgroup is None:
        return
    rows: list[tuple[str, str, float, str]] = []
    with tempfile.TemporaryDirectory(prefix="dlrover-autoscale-a-") as tmp:
        t = Path(tmp)
        script = [str(ORACLE), "--steps", str(steps), "--step-time", "0.05",
                  "--hold-mib", str(hold_mib)]  # fmt: skip
        (t / "ck1").mkdir()
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "1", "--max-restarts", "3", *script,
                    "--ckpt", str(t / "ck1"), "--out", str(t / "tr")]  # fmt: skip
        code, secs, _, _ = _timed(
            torchrun, _env(t / "home"), {}, 600, preexec=lambda: join_cgroup(cgroup.procs_files())
        )
        rows.append(("torchrun in a cgroup", "completed" if code == 0 else f"failed ({code})",
                     secs, f"{memory_mib} MiB every time, --max-restarts 3"))  # fmt: skip
        (t / "ck2").mkdir()
        ours = [sys.executable, "-m", "dlrover.cli.job", "submit", "--name", "under",
                "--memory", f"{memory_mib}Mi", *script,
                "--ckpt", str(t / "ck2"), "--out", str(t / "ours")]  # fmt: skip
        marks = {"relaunch": r"OOM-killed with (\d+) MiB; its replacement gets (\d+) MiB"}
        code, secs, _, log = _timed(ours, _env(t / "home2"), marks, 600)
        sizes = re.findall(r"OOM-killed with (\d+) MiB; its replacement gets (\d+) MiB", log)
        path = " -> ".join([sizes[0][0], *(b for _, b in sizes)]) + " MiB" if sizes else "-"
        rows.append(("dlrover submit", "completed" if code == 0 else f"failed ({code})", secs,
                     path))  # fmt: skip
    cgroup.remove()
    print(f"\n(a) one node, a worker holding {hold_mib} MiB, given {memory_mib} MiB; {steps} steps")
    print(f"{'run':<22} {'outcome':<12} {'seconds':>8}  memory")
    for name, outcome, secs, mem in rows:
        print(f"{name:<22} {outcome:<12} {secs:>8.1f}  {mem}")


# --- (b) ---------------------------------------------------------------------------------------
def part_b(steps: int, sample_time: float) -> None:
    rows: list[tuple[str, float, float | None]] = []
    for name, nnodes, flags in (
        ("fixed 1 node (MIN)", "1", []),
        ("fixed 3 nodes (MAX)", "3", []),
        ("1:3 --auto-scale", "1:3", ["--auto-scale"]),
    ):
        with tempfile.TemporaryDirectory(prefix="dlrover-autoscale-b-") as tmp:
            t = Path(tmp)
            cmd = [sys.executable, "-m", "dlrover.cli.job", "submit", "--name", "grow",
                   "--nnodes", nnodes, "--cpu", "1", "--memory", "2Gi", *flags, str(ELASTIC),
                   "--steps", str(steps), "--sample-time", str(sample_time),
                   "--ckpt", str(t / "ckpt")]  # fmt: skip
            env = _env(t / "home", DLROVER_AUTOSCALE_INTERVAL_S="2",
                       DLROVER_AUTOSCALE_COOLDOWN_S="5", DLROVER_AUTOSCALE_WINDOW_S="3")  # fmt: skip
            marks = {"max": r"round \d+ closed with 3 nodes"}
            code, secs, seen, log = _timed(cmd, env, marks, 900)
            if code != 0:
                print(log[-3000:], file=sys.stderr)
                raise SystemExit(f"{name}: exit {code}")
            rows.append((name, secs, seen.get("max")))
    base = rows[0][1]
    print(f"\n(b) examples/train_elastic.py, {steps} steps of a 12-sample global batch, "
          f"{sample_time}s per sample")  # fmt: skip
    print(f"{'run':<22} {'JCT s':>7} {'vs MIN':>7} {'at 3 nodes after s':>19}")
    for name, secs, at_max in rows:
        reach = "-" if at_max is None else f"{at_max:.1f}"
        print(f"{name:<22} {secs:>7.1f} {base / secs:>6.2f}x {reach:>19}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=["a", "b", "both"], default="both")
    p.add_argument("--memory-mib", type=int, default=600, help="(a) the node's memory")
    p.add_argument("--hold-mib", type=int, default=700, help="(a) what the worker holds")
    p.add_argument("--steps-a", type=int, default=40)
    p.add_argument("--steps-b", type=int, default=300)
    p.add_argument("--sample-time", type=float, default=0.02, help="(b) seconds per sample")
    a = p.parse_args()
    if a.part in ("a", "both"):
        part_a(a.memory_mib, a.hold_mib, a.steps_a)
    if a.part in ("b", "both"):
        part_b(a.steps_b, a.sample_time)


if __name__ == "__main__":
    main()
