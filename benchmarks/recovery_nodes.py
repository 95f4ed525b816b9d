"""Node-loss part of benchmarks/recovery.py: two simulated nodes, one lost, dlrover vs torchrun.

dlrover: `dlrover submit --nnodes MIN:2 --nproc-per-node 1` on the local engine (each node is an
agent process); the agent of rank 1, its zygote and its worker get SIGKILL together (the node is
gone) and the engine starts a replacement (a relaunch). With `--spares 1` a third agent waits,
its zygote warm, outside the world: it takes the lost node's place in the next round, with no
launch on the way, and the engine's replacement becomes the next spare. torchrun: two `torchrun --nnodes MIN:2 --rdzv-backend c10d`
processes on one rendezvous endpoint; the node of rank 1 (its torchrun and worker) gets SIGKILL
and, as an engine would, a replacement torchrun is started at once.
Measured from the kill: the first step at world size 1 (only with MIN = 1) and the first step
after the world is back at 2.
"""

from __future__ import annotations

import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from recovery_common import (
    TRAIN,
    Job,
    base_env,
    fmt,
    median,
    table,
    torchrun_cmd,
    wait_for,
    zygote_idle,
)


@dataclass
class NodeResult:
    shrunk: float | None = None
    regrown: float | None = None
    note: str = ""
    extra: dict[str, float] = field(default_factory=dict)


def _after_kill(
    jobs: list[Job], killed_at: float, old_pids: set[int], timeout: float
) -> NodeResult:
    """Wait for the first step of a new group at world 1 (if the job may shrink) and at world 2.

    Steps of the workers that ran before the kill do not count: one may finish the step whose
    all-reduce completed just before its peer died."""
    res = NodeResult()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = [
            s
            for job in jobs
            for s in job.steps()
            if s["ended"] > killed_at and int(s["pid"]) not in old_pids
        ]
        small = [s["ended"] for s in steps if int(s["world"]) == 1]
        if small and res.shrunk is None:
            res.shrunk = min(small) - killed_at
        full = [s["ended"] for s in steps if int(s["world"]) == 2]
        if full:
            res.regrown = min(full) - killed_at
            return res
        if all(job.popen.poll() is not None for job in jobs):
            res.note = "every launcher exited"
            return res
        time.sleep(0.02)
    res.note = f"not back at 2 nodes within {timeout:.0f}s"
    return res


def dlrover_node_loss(
    out: Path, nnodes: str, timeout: float, step_time: float, spares: int = 0
) -> NodeResult:
    env = base_env(DLROVER_HOME=str(out / "home"))
    cmd = [
        sys.executable, "-m", "dlrover.cli.job", "submit", "--name", "bench", "--nnodes", nnodes,
        "--nproc-per-node", "1", "--max-restarts", "3", *(["--spares", str(spares)] if spares else []),
        TRAIN, "--out", str(out), "--step-time", str(step_time),
    ]  # fmt: skip
    job = Job.start(cmd, out, env)
    try:
        if not wait_for(lambda: len(job.steps()) >= 3, 120.0):
            return NodeResult(note="never made 3 steps")
        if not wait_for(lambda: zygote_idle(job, 2 + spares), 60.0, 0.2):
            return NodeResult(note="zygotes never ready")
        time.sleep(1.0)
        _, agent = job.pid_of(1)
        old_pids = {int(p["pid"]) for p in job.procs()}
        killed_at = time.time()
        kill_tree(agent)
        return _after_kill([job], killed_at, old_pids, timeout)
    finally:
        job.finish(timeout=20.0)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def torchrun_node_loss(
    out: Path,
    nnodes: str,
    timeout: float,
    step_time: float,
    replace: bool = True,
    lose_store_host: bool = False,
) -> NodeResult:
    port = _free_port()
    flags = [
        f"--nnodes={nnodes}", "--nproc-per-node=1", "--max-restarts=3", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=bench",
    ]  # fmt: skip
    env = base_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")

    def node(name: str) -> Job:
        # Every node writes into the same directory, like workers of one job on a shared disk.
        argv = [*torchrun_cmd(*flags), TRAIN, "--out", str(out), "--step-time", str(step_time)]
        return Job.start(argv, out / name, env)

    jobs = [node("node-a")]
    # Node A hosts the rendezvous store: it is "the first node" because it binds the port first.
    if not wait_for(lambda: _listening(port), 60.0, 0.05):
        jobs[0].kill()
        return NodeResult(note="node A never opened the rendezvous port")
    jobs.append(node("node-b"))
    try:
        probe = Job(jobs[0].popen, out)  # steps and pid files live in `out`
        if not wait_for(lambda: len(probe.steps()) >= 3, 120.0):
            return NodeResult(note="never made 3 steps")
        time.sleep(1.0)
        victim, _ = probe.pid_of(1)
        host = next((j for j in jobs if _is_ancestor(j.popen.pid, victim)), None)
        if lose_store_host:
            host = jobs[0]
        if host is None:
            return NodeResult(note="cannot tell which torchrun runs rank 1")
        old_pids = {int(p["pid"]) for p in probe.procs()}
        killed_at = time.time()
        kill_tree(host.popen.pid)
        if replace:
            jobs.append(node("node-c"))  # the replacement, at once
        survivors = [j for j in jobs if j is not host]
        # Steps and pids live in `out`; the probe only needs a launcher that is still there.
        res = _after_kill([Job(survivors[0].popen, out)], killed_at, old_pids, timeout)
        if host is jobs[0]:
            res.note = (res.note + "; " if res.note else "") + "the lost node hosted the store"
        codes = [j.popen.poll() for j in survivors]
        if any(code is not None for code in codes):
            res.note += f"; survivors' exit codes {codes}"
        return res
    finally:
        alive = [j for j in jobs if j.popen.poll() is None] or jobs
        probe = Job(alive[0].popen, out)  # steps, pids and stop_at live in `out`
        probe.finish(timeout=20.0)
        probe.kill()  # also every worker it recorded
        for job in jobs:
            job.kill()


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything under it at once: the node is gone. (torchrun's workers
    are in sessions of their own, so killing its process group would leave them running.)"""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


def _is_ancestor(ancestor: int, pid: int) -> bool:
    try:
        return any(p.pid == ancestor for p in psutil.Process(pid).parents())
    except psutil.NoSuchProcess:
        return False


Variant = Callable[[Path, str, float, float], NodeResult]


def _variants(extra: bool) -> list[tuple[str, Variant, int]]:
    """(name, run, reps cap); the extra torchrun cases run once (one of them waits out a timeout)."""
    out: list[tuple[str, Variant, int]] = [
        ("dlrover submit (relaunch)", dlrover_node_loss, 1 << 30),
        (
            "dlrover submit --spares 1 (hot spare)",
            lambda o, n, t, s: dlrover_node_loss(o, n, t, s, spares=1),
            1 << 30,
        ),
        ("torchrun c10d", torchrun_node_loss, 1 << 30),
    ]
    if extra:
        out += [
            (
                "torchrun c10d, no replacement",
                lambda o, n, t, s: torchrun_node_loss(o, n, t, s, replace=False),
                1,
            ),
            (
                "torchrun c10d, store host lost",
                lambda o, n, t, s: torchrun_node_loss(o, n, t, s, lose_store_host=True),
                1,
            ),
        ]
    return out


def node_loss(
    reps: int, timeout: float, step_time: float, root: Path, sizes: list[str], extra: bool
) -> str:
    rows = []
    for nnodes in sizes:
        variants = _variants(extra and nnodes.startswith("1:"))
        results: dict[str, list[NodeResult]] = {name: [] for name, _, _ in variants}
        for rep in range(reps):
            for index, (name, fn, cap) in enumerate(variants):
                if rep >= cap:
                    continue
                out = root / f"node-{nnodes.replace(':', '_')}-{rep}-{index}"
                out.mkdir(parents=True)
                res = fn(out, nnodes, timeout, step_time)
                results[name].append(res)
                print(
                    f"  node loss --nnodes {nnodes}, {name}, rep {rep + 1}/{reps}: "
                    f"world 1 after {fmt(res.shrunk)} s, world 2 after {fmt(res.regrown)} s"
                    + (f" ({res.note})" if res.note else ""),
                    flush=True,
                )
        for name, runs in results.items():
            notes = sorted({r.note for r in runs if r.note})
            rows.append(
                [
                    f"`--nnodes {nnodes}`",
                    name,
                    f"{sum(1 for r in runs if r.regrown is not None)}/{len(runs)}",
                    fmt(median([r.shrunk for r in runs if r.shrunk is not None])),
                    fmt(median([r.regrown for r in runs if r.regrown is not None])),
                    "; ".join(notes) or "",
                ]
            )
    head = [
        "nodes",
        "launcher",
        "back at 2 nodes",
        "kill → step at 1 node (s)",
        "kill → step at 2 nodes (s)",
        "notes",
    ]
    title = "### Node loss: SIGKILL of the node of rank 1, a replacement started at once"
    return "\n".join([title, "", table(head, rows)])
