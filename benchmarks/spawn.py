"""Time from a spawn request to the first DDP step: plain `python script.py` vs zygote fork.

Run: PYTHONPATH=. python benchmarks/spawn.py [--repeats 5]
Both workers of a 2-rank gloo DDP job are started together; they rendezvous through
init_process_group(env://) on a TCPStore at a fresh port. Prints a table of medians per
start-up phase and the ratio plain / zygote.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from dlrover.agent.zygote import WorkerHandle, Zygote
from dlrover.testing.launch import spawn_popen

WORKER = str(Path(__file__).resolve().with_name("ddp_first_step.py"))
PHASES = ("start", "import", "process_group", "ddp_optimizer", "first_step")
WORLD_SIZE = 2


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker_env(rank: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
        LOCAL_WORLD_SIZE=str(WORLD_SIZE),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        TORCHELASTIC_RESTART_COUNT="0",
    )
    return env


def _spawn_plain(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> object:
    with open(out, "ab") as stdout, open(err, "ab") as stderr:
        return subprocess.Popen(
            [sys.executable, *argv], env=env, cwd=cwd, stdout=stdout, stderr=stderr
        )


def _wait(handle: object, timeout: float) -> int | None:
    if isinstance(handle, subprocess.Popen):
        return handle.wait(timeout)
    assert isinstance(handle, WorkerHandle)
    return handle.wait(timeout)


def one_run(spawn: Callable[..., object], workdir: Path) -> dict[str, float]:
    """Spawn both ranks; seconds from the spawn request to the end of each phase (slowest rank)."""
    port = _free_port()
    requested = time.time()
    handles = []
    for rank in range(WORLD_SIZE):
        out, err = workdir / f"out{rank}", workdir / f"err{rank}"
        out.write_text("")
        handles.append(spawn([WORKER], _worker_env(rank, port), str(workdir), str(out), str(err)))
    result: dict[str, float] = {"exit_failures": 0.0}
    for rank, handle in enumerate(handles):
        returncode = _wait(handle, 120)
        output = (workdir / f"out{rank}").read_text()
        if not output:
            raise RuntimeError(
                f"rank {rank} ended with {returncode} before its first step: "
                f"{(workdir / f'err{rank}').read_text()}"
            )
        # A crash during interpreter shutdown (after the measured step) is counted, not fatal.
        result["exit_failures"] += returncode != 0
    for rank in range(WORLD_SIZE):
        phases = json.loads((workdir / f"out{rank}").read_text())["phases"]
        for phase in PHASES:
            result[phase] = max(result.get(phase, 0.0), phases[phase] - requested)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    started = time.perf_counter()
    zygote = Zygote.start()
    zygote_start = time.perf_counter() - started
    runs: dict[str, list[dict[str, float]]] = {"plain python": [], "bootstrap": [], "zygote": []}
    spawners: dict[str, Callable[..., object]] = {
        "plain python": _spawn_plain,
        "bootstrap": spawn_popen,
        "zygote": zygote.spawn,
    }
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.repeats):  # interleaved: the machine's load hits all alike
                for name, spawn in spawners.items():
                    runs[name].append(one_run(spawn, Path(tmp)))
    finally:
        zygote.close()
    print(f"zygote start (one-time, preload {zygote.preload_s:.2f} s): {zygote_start:.2f} s")
    print(f"median seconds from spawn request to end of phase, {args.repeats} runs, 2 ranks")
    print(f"{'mode':<14}" + "".join(f"{phase:>15}" for phase in PHASES))
    for name, samples in runs.items():
        medians = [statistics.median(sample[phase] for sample in samples) for phase in PHASES]
        print(f"{name:<14}" + "".join(f"{value:>15.3f}" for value in medians))
    plain = statistics.median(sample["first_step"] for sample in runs["plain python"])
    forked = statistics.median(sample["first_step"] for sample in runs["zygote"])
    spread = [round(sample["first_step"], 3) for sample in runs["zygote"]]
    crashes = {name: int(sum(sample["exit_failures"] for sample in runs[name])) for name in runs}
    print(f"ranks that crashed during shutdown, after their first step: {crashes}")
    print(f"first step: plain {plain:.3f} s, zygote {forked:.3f} s, ratio {plain / forked:.1f}x")
    print(f"zygote first-step samples: {spread}")


if __name__ == "__main__":
    main()
