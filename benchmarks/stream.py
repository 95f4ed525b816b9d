"""Benchmark of online learning from Kafka: reading through the master vs a plain consumer.

Run: PYTHONPATH=. python benchmarks/stream.py [--records 300000] [--shard auto,1024] [--repeats 5]
Needs confluent-kafka and noida-db==0.2.3 (the broker it starts on loopback). Prints, as medians
of --repeats rounds that each measure the plain consumer and the dataset back to back:

- read only: records/s of one plain confluent-kafka consumer reading the whole topic with
  assign() (the peer: what a script does without DLRover), from the consumer's creation on, and
  of ElasticStreamDataset (the master leases offset ranges, a thread reads them ahead of the
  loop with one consumer that stays assigned), taken one record at a time and through
  ``dataset.batches(500)`` (lists cut from the ranges). 300 k records: with 60 k, the plain consumer's
  whole read took ~50 ms, so both rates were mostly start-up;
- a training loop: batches of --batch records with --step-ms of simulated compute each, fed by
  the plain consumer in the loop, by the plain consumer wrapped in an IterableDataset through a
  DataLoader (the DataLoader's own cost per batch, ~0.17 ms here after a step's sleep, is then
  in both), by the dataset through a DataLoader, or by ``dataset.batches(--batch)`` (no
  DataLoader, as the plain consumer in the loop), against the compute alone;
- the CPU the read-only passes cost, per 100 k records, in every process they touch: this one
  (the loop and the reader's threads), the master and the broker (benchmarks/cpu_account.py,
  from /proc), each way next to the plain consumer's: the figure that does not depend on
  how many cores the machine has;
- the latency of state_dict() (the exactly-once position: one round trip to the master), called
  every 2000 records while reading flat out, and every 8 steps of the training loop (as a
  checkpoint takes it), each in a pass of its own at the first --shard, next to a plain
  consumer's synchronous commit of its offsets.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.utils.data import IterableDataset

from dlrover.client.sharding import connect

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.cpu_account import CpuAccount, cpu_table  # noqa: E402
from benchmarks.sharding import GrpcMaster  # noqa: E402
from tests.kafka_broker import KafkaBroker, kafka_missing  # noqa: E402

PARTITIONS = 3
_RUNS = itertools.count()
VALUE = b"x" * 100


def plain_consumer(
    broker: KafkaBroker, topic: str, per_partition: int, batch: int = 0, step_s: float = 0.0
) -> float:
    """Seconds for one consumer to read every record with assign() (no group membership);
    with ``batch``, ``step_s`` of compute per ``batch`` records."""
    from confluent_kafka import Consumer, TopicPartition

    start = time.perf_counter()  # from nothing, as the dataset's time (its consumer is lazy)
    consumer = Consumer(
        {
            "bootstrap.servers": broker.bootstrap,
            "group.id": "bench-plain",
            "enable.auto.commit": False,
        }
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
    left = per_partition * PARTITIONS
    while left:
        want = min(batch or 500, left)
        got = 0
        while got < want:
            for message in consumer.consume(num_messages=want - got, timeout=1.0):
                if message.error() is None:
                    got += 1
        left -= got
        if step_s:
            time.sleep(step_s)  # compute: an accelerator's step, the CPU waits
    elapsed = time.perf_counter() - start
    consumer.close()
    return elapsed


class PlainConsumerDataset(IterableDataset[bytes | None]):
    """The plain consumer as a script would feed it to a DataLoader: an IterableDataset whose
    iterator assign()s every partition from offset 0 and yields each record's value."""

    def __init__(self, bootstrap: str, topic: str, per_partition: int) -> None:
        self.bootstrap, self.topic, self.total = bootstrap, topic, per_partition * PARTITIONS
        self.per_partition = per_partition

    def __iter__(self) -> Iterator[bytes | None]:
        from confluent_kafka import Consumer, TopicPartition

        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": "bench-loader",
                "enable.auto.commit": False,
            }
        )
        consumer.assign([TopicPartition(self.topic, p, 0) for p in range(PARTITIONS)])
        left = self.total
        try:
            while left:
                for message in consumer.consume(num_messages=min(500, left), timeout=1.0):
                    if message.error() is None:
                        left -= 1
                        yield message.value()
        finally:
            consumer.close()


def plain_loader(
    broker: KafkaBroker, topic: str, per_partition: int, batch: int, step_s: float
) -> float:
    """Seconds of the training loop fed by the plain consumer through a DataLoader (the same
    DataLoader the dataset goes through: its own cost per batch is in both)."""
    from torch.utils.data import DataLoader

    dataset = PlainConsumerDataset(broker.bootstrap, topic, per_partition)
    start = time.perf_counter()
    count = 0
    for values in DataLoader(dataset, batch_size=batch, num_workers=0):
        count += len(values)
        time.sleep(step_s)
    elapsed = time.perf_counter() - start
    assert count == per_partition * PARTITIONS, count
    return elapsed


def stream_dataset(
    broker: KafkaBroker,
    master: GrpcMaster,
    topic: str,
    per_partition: int,
    shard: int | None,
    batch: int = 0,
    step_s: float = 0.0,
    state_every: int = 0,
    batched: int = 0,
) -> tuple[float, list[float]]:
    """Seconds for ElasticStreamDataset to read every record (with ``batch``: through a
    DataLoader, ``step_s`` of compute per batch; with ``batched``, ``dataset.batches(batched)``
    instead of a DataLoader or of one record at a time), and, with ``state_every``, the
    latencies (s) of state_dict() called every that many records (not counted in the
    seconds)."""
    from torch.utils.data import DataLoader

    from dlrover.trainer.torch.elastic.stream import ElasticStreamDataset

    dataset: Any = ElasticStreamDataset(
        topic,
        broker.bootstrap,
        name=f"{topic}-{shard}-{batch}-{next(_RUNS)}",  # a new stream each run
        records_per_shard=shard,
        end_offsets={p: per_partition for p in range(PARTITIONS)},
        transport=connect(master.addr, master.token),
        worker_id="bench/0",
    )
    latencies: list[float] = []
    start = time.perf_counter()
    count = 0
    if batch or batched:
        steps = (
            dataset.batches(batched)
            if batched
            else DataLoader(dataset, batch_size=batch, num_workers=0)
        )
        for values in steps:
            count += len(values)
            if step_s:
                time.sleep(step_s)
            if state_every and count // state_every != (count - len(values)) // state_every:
                t = time.perf_counter()
                dataset.state_dict()  # after the step, as a checkpoint takes it
                latencies.append(time.perf_counter() - t)
    else:
        for _ in dataset:
            count += 1
            if state_every and count % state_every == 0:
                t = time.perf_counter()
                dataset.state_dict()
                latencies.append(time.perf_counter() - t)
    # The state_dict() calls are timed on their own (their own table), not in the rate.
    elapsed = time.perf_counter() - start - sum(latencies)
    dataset.close()
    assert count == per_partition * PARTITIONS, count
    return elapsed, latencies


def plain_commit_latency(broker: KafkaBroker, topic: str, rounds: int = 20) -> list[float]:
    """Latencies of a plain consumer's synchronous commit of its offsets (the peer's way to
    remember a position)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "bench-commit"})
    out = []
    for i in range(rounds):
        offsets = [TopicPartition(topic, p, i + 1) for p in range(PARTITIONS)]
        t = time.perf_counter()
        consumer.commit(offsets=offsets, asynchronous=False)
        out.append(time.perf_counter() - t)
    consumer.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, default=300000, help="records in the topic")
    p.add_argument(
        "--shard",
        default="auto,1024",
        help="records_per_shard values (auto: the default, ranges growing from 1024 to 16384)",
    )
    p.add_argument("--batch", type=int, default=256, help="records per training step")
    p.add_argument("--step-ms", type=float, default=5.0, help="simulated compute per step")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    args = p.parse_args()
    missing = kafka_missing()
    if missing:
        sys.exit(f"cannot run: {missing}")
    per_partition = args.records // PARTITIONS
    total = per_partition * PARTITIONS
    shards = [None if x == "auto" else int(x) for x in args.shard.split(",")]
    step_s = args.step_ms / 1000
    steps = -(-total // args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        broker = KafkaBroker(Path(tmp))
        master = GrpcMaster()  # a process of its own, as under dlrover-run
        try:
            broker.create_topic("bench", PARTITIONS)
            for p_ in range(PARTITIONS):
                broker.produce("bench", [(p_, VALUE)] * per_partition)
            plain_consumer(broker, "bench", per_partition)  # warm the broker's caches
            load = os.getloadavg()[0]
            assert broker.proc is not None
            account = CpuAccount(
                {"this process": os.getpid(), "master": master.proc.pid, "broker": broker.proc.pid}
            )
            cpu: dict[str, dict[str, float]] = {}

            def add_cpu(row: str, used: dict[str, float]) -> None:
                into = cpu.setdefault(row, {})
                for name, seconds in used.items():
                    into[name] = into.get(name, 0.0) + seconds

            read: dict[str, list[float]] = {"plain": []}
            loop: dict[str, list[float]] = {"plain": [], "loader": []}
            state_ms: list[float] = []
            state_batched_ms: list[float] = []
            state_loop_ms: list[float] = []
            # Interleaved: every round measures the plain consumer and the dataset back to
            # back, so a load that comes and goes hits both alike.
            for _ in range(args.repeats):
                with account.measure() as used:
                    read["plain"].append(plain_consumer(broker, "bench", per_partition))
                add_cpu(  # a plain consumer's job has no master
                    "plain confluent-kafka, assign()",
                    {k: v for k, v in used.items() if k != "master"},
                )
                for shard in shards:
                    with account.measure() as used:
                        seconds, _ = stream_dataset(broker, master, "bench", per_partition, shard)
                    add_cpu(_name(str(shard)), used)
                    read.setdefault(str(shard), []).append(seconds)
                    with account.measure() as used:
                        seconds, _ = stream_dataset(
                            broker, master, "bench", per_partition, shard, batched=500
                        )
                    add_cpu(_name(f"{shard} batches"), used)
                    read.setdefault(f"{shard} batches", []).append(seconds)
                # The position while reading: a pass of its own, so that the read-only rate is
                # of reading alone (the plain consumer's loop remembers no position).
                _, latencies = stream_dataset(
                    broker, master, "bench", per_partition, shards[0], state_every=2000
                )
                state_ms += [x * 1000 for x in latencies]
                _, latencies = stream_dataset(
                    broker, master, "bench", per_partition, shards[0], state_every=2000,
                    batched=500,
                )  # fmt: skip
                state_batched_ms += [x * 1000 for x in latencies]
                _, latencies = stream_dataset(
                    broker,
                    master,
                    "bench",
                    per_partition,
                    shards[0],
                    args.batch,
                    step_s,
                    state_every=8 * args.batch,
                )
                state_loop_ms += [x * 1000 for x in latencies]
                loop["plain"].append(
                    plain_consumer(broker, "bench", per_partition, args.batch, step_s)
                )
                loop["loader"].append(
                    plain_loader(broker, "bench", per_partition, args.batch, step_s)
                )
                for shard in shards:
                    seconds, _ = stream_dataset(
                        broker, master, "bench", per_partition, shard, args.batch, step_s
                    )
                    loop.setdefault(str(shard), []).append(seconds)
                    seconds, _ = stream_dataset(
                        broker, master, "bench", per_partition, shard, 0, step_s,
                        batched=args.batch,
                    )  # fmt: skip
                    loop.setdefault(f"{shard} batches", []).append(seconds)
            commit_ms = [x * 1000 for x in plain_commit_latency(broker, "bench")]
        finally:
            master.close()
            broker.stop()
    med = {k: statistics.median(v) for k, v in read.items()}
    print(
        f"{total} records of {len(VALUE)} B in {PARTITIONS} partitions, one reader; medians of "
        f"{args.repeats} interleaved rounds; load average {load:.1f} / {os.getloadavg()[0]:.1f} "
        f"(before / after) on {os.cpu_count()} cores\n"
    )
    print(f"| {'read only':46} | {'records/s':>10} | {'min-max k/s':>13} | {'vs plain':>8} |")
    print(f"|{'-' * 48}|{'-' * 12}|{'-' * 15}|{'-' * 10}|")
    for key, values in read.items():
        name = "plain confluent-kafka, assign()" if key == "plain" else _name(key)
        spread = f"{total / max(values) / 1e3:.0f}-{total / min(values) / 1e3:.0f}"
        print(
            f"| {name:46} | {total / med[key]:10.0f} | {spread:>13} | "
            f"{med['plain'] / med[key]:8.2f} |"
        )
    print(
        f"\nCPU of the read-only passes, summed over {args.repeats} rounds of each, per 100 k "
        f"records\n"
    )
    work = total * args.repeats / 1e5
    print(cpu_table(cpu, work, "100 k records, read only", "plain confluent-kafka, assign()"))
    ideal = steps * step_s
    lmed = {k: statistics.median(v) for k, v in loop.items()}
    print(
        f"\nTraining loop: {steps} steps of {args.batch} records, {args.step_ms:g} ms compute "
        f"each (compute alone {ideal:.2f} s)\n"
    )
    print(
        f"| {'reader':46} | {'seconds':>10} | {'vs compute':>10} | {'vs plain loop':>13} | "
        f"{'vs plain DataLoader':>19} |"
    )
    print(f"|{'-' * 48}|{'-' * 12}|{'-' * 12}|{'-' * 15}|{'-' * 21}|")
    names = {"plain": "plain consumer in the loop", "loader": "plain consumer, DataLoader"}
    for key in loop:
        name = names.get(key) or _name(key)
        print(
            f"| {name:46} | {lmed[key]:10.2f} | {lmed[key] / ideal:10.2f} | "
            f"{lmed[key] / lmed['plain']:13.2f} | {lmed[key] / lmed['loader']:19.2f} |"
        )
    print(f"\n| {'remembering the position':46} | {'median ms':>10} | {'p90 ms':>8} |")
    print(f"|{'-' * 48}|{'-' * 12}|{'-' * 10}|")
    for name, values in (
        ("state_dict(), reading flat out", state_ms),
        ("state_dict(), batches(500) flat out", state_batched_ms),
        ("state_dict(), in the loop, every 8 steps", state_loop_ms),
        ("plain consumer commit(sync) to broker", commit_ms),
    ):
        p90 = statistics.quantiles(values, n=10)[-1]
        print(f"| {name:46} | {statistics.median(values):10.2f} | {p90:8.2f} |")


def _name(key: str) -> str:
    """The table's name of a dataset setting: "1024" (per record, or through a DataLoader in
    the loop), "1024 batches" (``dataset.batches(n)``)."""
    shard, _, how = key.partition(" ")
    size = "1024-16384 (auto)" if shard == "None" else shard
    return f"ElasticStreamDataset, {size}/range" + (", batches()" if how else "")


if __name__ == "__main__":
    main()
