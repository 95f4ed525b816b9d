"""The process that runs the node check's tests: ``python -m dlrover.agent.check_worker``.

The agent starts it once per check (it imports torch, which the agent never does) and talks to
it in JSON lines: the worker says `WorkerReady` once torch is imported, then answers each
`CheckRun` on stdin with a `CheckDone` on stdout, until stdin closes.

One run: a compute test (a fixed number of matmuls, one thread on CPU, timed in CPU seconds; on
a GPU, larger ones on the GPU, timed by the wall clock) and, in a group of two or more, a collective test: a process group over the group's
store (hosted by peers[0]), three allreduces whose sums are checked, a barrier, teardown.
Faults for tests come from the agent (`slow_factor`, `fail_collective`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from dlrover.json_messages import MessageError, decode_tagged, encode, parse

COMPUTE_MATMULS = 100
CPU_MATRIX = 384
GPU_MATRIX = 4096
ALLREDUCE_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class WorkerReady:
    """Torch is imported; ``backend`` is what collectives use (gloo, or nccl on a GPU)."""

    backend: str


@dataclass(frozen=True)
class CheckRun:
    """Run the tests in the group ``peers`` (host:port each) as rank ``index``."""

    peers: list[str]
    index: int
    timeout_s: float
    slow_factor: float = 1.0
    fail_collective: bool = False


@dataclass(frozen=True)
class CheckDone:
    """A run's result: seconds of the compute and collective tests, or the error."""

    ok: bool
    compute_s: float = 0.0
    comm_s: float = 0.0
    error: str = ""


def _compute(torch: Any, gpu: bool, slow_factor: float) -> float:
    if gpu:
        a = torch.randn(GPU_MATRIX, GPU_MATRIX, device="cuda")
        torch.cuda.synchronize()
    else:
        a = torch.randn(CPU_MATRIX, CPU_MATRIX)
    b = a @ a  # warm-up
    # On a CPU, the CPU time of this thread: nodes that share a machine (tests, or several
    # nodes per host) must not make each other look slow. On a GPU, the wall time.
    clock = time.perf_counter if gpu else time.thread_time
    start = clock()
    for _ in range(COMPUTE_MATMULS):
        b = a @ a
    if gpu:
        torch.cuda.synchronize()
    elapsed = clock() - start
    if not bool(torch.isfinite(b).all()):
        raise RuntimeError("the matmul produced non-finite values")
    if slow_factor > 1:
        time.sleep((slow_factor - 1) * elapsed)  # an injected slow node
        elapsed *= slow_factor
    return elapsed


def _collective(torch: Any, run: CheckRun, backend: str, gpu: bool) -> float:
    import torch.distributed as dist

    host, port = run.peers[0].rsplit(":", 1)
    size = len(run.peers)
    timeout = timedelta(seconds=run.timeout_s)
    start = time.perf_counter()
    store = dist.TCPStore(host, int(port), size, is_master=run.index == 0, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=run.index, world_size=size, timeout=timeout)
    try:
        device = "cuda" if gpu else "cpu"
        for _ in range(3):
            t = torch.full((ALLREDUCE_ELEMENTS,), float(run.index + 1), device=device)
            dist.all_reduce(t)
            expected = size * (size + 1) / 2
            if not bool((t == expected).all()):
                raise RuntimeError(f"allreduce returned {t[0].item()}, expected {expected}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return time.perf_counter() - start


def run_check(torch: Any, run: CheckRun, backend: str, gpu: bool) -> CheckDone:
    """One run of the tests; every failure becomes a CheckDone with the error."""
    try:
        compute_s = _compute(torch, gpu, run.slow_factor)
    except Exception as e:  # a broken device is the check's finding, not a crash
        return CheckDone(False, error=f"compute test failed: {type(e).__name__}: {e}")
    if len(run.peers) < 2:
        return CheckDone(True, compute_s)
    if run.fail_collective:
        return CheckDone(False, compute_s, error="collective test failed: injected fault")
    try:
        comm_s = _collective(torch, run, backend, gpu)
    except Exception as e:
        text = str(e).splitlines()[0] if str(e) else ""
        return CheckDone(
            False, compute_s, error=f"collective test failed: {type(e).__name__}: {text[:200]}"
        )
    return CheckDone(True, compute_s, comm_s)


def main() -> int:
    """Serve runs from stdin until it closes."""
    import torch

    torch.set_num_threads(1)  # nodes on one machine must not measure each other's contention
    gpu = torch.cuda.is_available()
    backend = "nccl" if gpu else "gloo"
    if gpu:
        torch.cuda.set_device(0)
    out = sys.stdout.buffer
    out.write(encode(WorkerReady(backend), event="ready"))
    out.flush()
    for line in sys.stdin.buffer:
        if not line.strip():
            continue
        try:
            doc = parse(line, "node check request")
            run = decode_tagged(doc, "op", {"run": CheckRun}, "node check request")
        except MessageError as e:
            done = CheckDone(False, error=f"bad request: {e}")
        else:
            done = run_check(torch, run, backend, gpu)
        out.write(encode(done, event="done"))
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
