"""Benchmark of dynamic sharding: a straggler epoch vs torch's static split, and master capacity.

Run: PYTHONPATH=. python benchmarks/sharding.py [--transport module:factory]
The factory takes a ShardManager and returns a ShardingTransport (default: in-process), so the
same run measures the master over gRPC once that transport exists.

``--leases-held 10,1000,5000 [--against REV]``: only the master's CPU for one lease and its
report while that many leases are held by other workers (its sharding part on a SQLite state, as
`dlrover-master` keeps it), this tree beside REV's in the same run.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import threading
import time
from collections.abc import Callable

from recovery_common import master_cmd
from torch.utils.data import DistributedSampler

from dlrover.client.sharding_client import ShardingClient
from dlrover.client.sharding_transport import ShardingTransport
from dlrover.sharding import DatasetSpec, ShardManager
from dlrover.testing.sharding import InProcessTransport

TransportFactory = Callable[[ShardManager], ShardingTransport]


class GrpcMaster:
    """A real dlrover-master process (default SQLite state) that each factory call connects to."""

    def __init__(self, *extra: str) -> None:
        import os
        import subprocess
        import tempfile
        import time

        self._dir = tempfile.mkdtemp(prefix="dlrover_bench_")
        env_file = os.path.join(self._dir, "master.env")
        self.proc = subprocess.Popen(
            master_cmd(env_file, os.path.join(self._dir, "state.db"), *extra),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while not os.path.exists(env_file):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("dlrover-master did not start")
            time.sleep(0.02)
        with open(env_file) as f:
            lines = dict(x.split("=", 1) for x in f.read().split())
        self.addr, self.token = lines["DLROVER_MASTER_ADDR"], lines["DLROVER_JOB_TOKEN"]
        self._n = 0

    def factory(self, manager: ShardManager) -> ShardingTransport:
        from dlrover.client.sharding import connect

        # The master owns its manager; each call gets a fresh dataset name space via a new master
        # would cost a process, so datasets are told apart by the benchmark's own names.
        return connect(self.addr, self.token)

    def close(self) -> None:
        import shutil

        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


def load_factory(spec: str | None) -> TransportFactory:
    if not spec:
        return InProcessTransport
    module_name, _, attribute = spec.partition(":")
    factory: TransportFactory = getattr(importlib.import_module(module_name), attribute)
    return factory


class SimulatedCompute:
    """Per-batch work at a fixed speed: sleeps to a schedule, so sleep overshoot does not add up."""

    def __init__(self, seconds_per_batch: float) -> None:
        self.seconds_per_batch = seconds_per_batch
        self.due = time.perf_counter()

    def batch(self) -> None:
        self.due += self.seconds_per_batch
        delay = self.due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


def run_threads(targets: list[Callable[[], None]], timeout_s: float) -> float:
    """Start all targets together; return the time until the last one finished."""
    start_gate = threading.Barrier(len(targets) + 1)

    def gated(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            start_gate.wait(timeout_s)
            target()

        return run

    threads = [threading.Thread(target=gated(t)) for t in targets]
    for thread in threads:
        thread.start()
    start_gate.wait(timeout_s)
    start = time.perf_counter()
    for thread in threads:
        thread.join(timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"a benchmark worker did not finish within {timeout_s}s")
    return time.perf_counter() - start


def straggler_static(args: argparse.Namespace, speeds: list[float]) -> float:
    size = args.batches * args.batch_size

    def worker(rank: int) -> Callable[[], None]:
        sampler: DistributedSampler[int] = DistributedSampler(
            range(size),  # type: ignore[arg-type]  # any Sized works
            num_replicas=args.workers,
            rank=rank,
            seed=0,
        )

        def run() -> None:
            compute = SimulatedCompute(speeds[rank])
            indices = list(sampler)
            for _ in range(0, len(indices), args.batch_size):
                compute.batch()

        return run

    return run_threads([worker(r) for r in range(args.workers)], timeout_s=600)


def straggler_dynamic(
    args: argparse.Namespace, speeds: list[float], factory: TransportFactory
) -> float:
    transport = factory(ShardManager())
    spec = DatasetSpec(
        "straggler",
        size=args.batches * args.batch_size,
        batch_size=args.batch_size,
        batches_per_shard=args.batches_per_shard,
        shuffle=True,
    )
    batches_done = [0] * args.workers

    def worker(rank: int) -> Callable[[], None]:
        client = ShardingClient(transport, spec, f"bench/{rank}", prefetch=args.prefetch)

        def run() -> None:
            compute = SimulatedCompute(speeds[rank])
            with client:
                while (shard := client.next_shard(60.0)) is not None:
                    for _ in range(0, len(shard), args.batch_size):
                        compute.batch()
                        batches_done[rank] += 1
                    client.report_done(shard)

        return run

    elapsed = run_threads([worker(r) for r in range(args.workers)], timeout_s=600)
    assert sum(batches_done) == args.batches, batches_done
    return elapsed


def master_capacity(args: argparse.Namespace, factory: TransportFactory) -> dict[str, float]:
    transport = factory(ShardManager())
    total = args.clients * args.requests
    spec = DatasetSpec("capacity", size=total * 2, shard_size=1)
    transport.register_dataset(spec)
    latencies: list[list[float]] = [[] for _ in range(args.clients)]

    def client(index: int) -> Callable[[], None]:
        worker_id = f"cap/{index}"

        def run() -> None:
            for _ in range(args.requests):
                begin = time.perf_counter()
                result = transport.fetch_shards(spec.name, worker_id, 1)
                latencies[index].append(time.perf_counter() - begin)
                transport.report_done(spec.name, worker_id, [s.id for s in result.shards])

        return run

    elapsed = run_threads([client(i) for i in range(args.clients)], timeout_s=600)
    flat = sorted(x for per_client in latencies for x in per_client)
    single = []
    for _ in range(2000):
        begin = time.perf_counter()
        result = transport.fetch_shards(spec.name, "solo/0", 1)
        single.append(time.perf_counter() - begin)
        transport.report_done(spec.name, "solo/0", [s.id for s in result.shards])
    return {
        "fetch_per_s": total / elapsed,
        "rpc_per_s": 2 * total / elapsed,
        "p50_ms": 1e3 * flat[len(flat) // 2],
        "p99_ms": 1e3 * flat[int(len(flat) * 0.99)],
        "solo_p50_ms": 1e3 * statistics.median(single),
    }


_LEASE_COST = """
import os, sys, tempfile, time
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.state_store import SqliteStateStore
from dlrover.sharding.types import DatasetSpec
store = SqliteStateStore(os.path.join(tempfile.mkdtemp(), "state.db"))
sharding = JobMaster(JobMasterConfig(job_name="leases"), store).sharding
sharding.register_dataset(DatasetSpec(name="d", size=10**8, shard_size=1))
held = 0
for target in [int(n) for n in sys.argv[1].split(",")]:
    while held < target:
        sharding.fetch_shards("d", f"w{held % 100}", 1)
        held += 1
    start, n = time.process_time(), 300
    for i in range(n):
        (shard,) = sharding.fetch_shards("d", "probe", 1).shards
        sharding.report_done("d", "probe", [shard.id])
    print(target, (time.process_time() - start) / n * 1e3)
"""


def lease_cost(held: str, against: str) -> None:
    """``--leases-held``: ms of CPU per lease and its report, per number of leases held."""
    import os
    import subprocess
    import sys
    from contextlib import ExitStack
    from pathlib import Path

    from against import REPO, checkout

    with ExitStack() as stack:
        trees = [("this tree", REPO)]
        if against:
            trees.append((against, stack.enter_context(checkout(against))))
        ms: dict[str, dict[int, float]] = {}
        for name, tree in trees:
            out = subprocess.run(
                [sys.executable, "-c", _LEASE_COST, held],
                cwd=tree,
                env={**os.environ, "PYTHONPATH": str(Path(tree))},
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            ms[name] = {int(n): float(v) for n, v in (line.split() for line in out.splitlines())}
    names = [name for name, _ in trees]
    heads = [f"{n}: ms per lease + report" for n in names]
    if against:
        heads.append(f"{against} / this tree")
    print("| leases held | " + " | ".join(heads) + " |")
    print("|---|" + "---|" * len(heads))
    for count in ms[names[0]]:
        cells = [f"{ms[n][count]:.3f}" for n in names]
        if against:
            cells.append(f"{ms[names[1]][count] / ms[names[0]][count]:.1f}x")
        print(f"| {count:,} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--transport", default=None, help="module:factory(manager) -> transport")
    parser.add_argument(
        "--grpc",
        action="store_true",
        help="Clients talk to a real dlrover-master process over gRPC",
    )
    parser.add_argument(
        "--master-args", default="", help="extra dlrover-master flags, e.g. '--state-db memory'"
    )
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--batch-ms", type=float, default=4.0, help="fast worker, per batch")
    parser.add_argument("--slow-factor", type=float, default=3.0)
    parser.add_argument("--batches", type=int, default=2000, help="batches in the epoch")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--batches-per-shard", type=int, default=4)
    parser.add_argument("--prefetch", type=int, default=1)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=200, help="fetches per client")
    parser.add_argument(
        "--leases-held", default="", help="only the lease cost table at these counts, e.g. 10,1000"
    )
    parser.add_argument("--against", default="", help="with --leases-held: also at this commit")
    args = parser.parse_args()
    if args.leases_held:
        lease_cost(args.leases_held, args.against)
        return
    master = GrpcMaster(*args.master_args.split()) if args.grpc else None
    factory = master.factory if master is not None else load_factory(args.transport)

    fast = args.batch_ms / 1e3
    speeds = [fast] * (args.workers - 1) + [fast * args.slow_factor]
    ideal = args.batches / sum(1 / s for s in speeds)
    static = straggler_static(args, speeds)
    dynamic = straggler_dynamic(args, speeds, factory)
    print(
        f"\nStraggler epoch: {args.workers} workers, one {args.slow_factor:g}x slower, "
        f"{args.batches} batches of {args.batch_size}, {args.batch_ms:g} ms/batch (fast), "
        f"{args.batches_per_shard} batches/shard, prefetch {args.prefetch}"
    )
    print(f"| {'':28} | {'epoch s':>8} | {'vs ideal':>8} |")
    print(f"|{'-' * 30}|{'-' * 10}|{'-' * 10}|")
    for name, value in (
        ("ideal (work / total speed)", ideal),
        ("dynamic sharding (dlrover)", dynamic),
        ("static DistributedSampler", static),
    ):
        print(f"| {name:28} | {value:8.3f} | {value / ideal:8.3f} |")
    print(
        f"dynamic is {static / dynamic:.2f}x faster than static; "
        f"{dynamic / ideal - 1:+.1%} vs ideal"
    )

    capacity = master_capacity(args, factory)
    print(f"\nMaster capacity: {args.clients} concurrent clients x {args.requests} fetch+report")
    print(
        f"| {'fetch/s':>9} | {'rpc/s':>9} | {'p50 ms':>7} | {'p99 ms':>7} | {'solo p50 ms':>11} |"
    )
    print(f"|{'-' * 11}|{'-' * 11}|{'-' * 9}|{'-' * 9}|{'-' * 13}|")
    print(
        f"| {capacity['fetch_per_s']:9.0f} | {capacity['rpc_per_s']:9.0f} | "
        f"{capacity['p50_ms']:7.3f} | {capacity['p99_ms']:7.3f} | {capacity['solo_p50_ms']:11.4f} |"
    )
    if master is not None:
        master.close()


if __name__ == "__main__":
    main()
