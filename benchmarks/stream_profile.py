"""Where ElasticStreamDataset's time per range goes: the broker's re-positioning and the master's
round trips, each measured alone.

Run: PYTHONPATH=. python benchmarks/stream_profile.py [--records 1024] [--rounds 15]
Needs confluent-kafka and noida-db==0.2.3. Prints medians (ms) of
- a consumer re-positioned on a partition (assign(), or seek()) until its first record, and the
  same consumer reading on through --records records (what a range costs when it continues);
- one round trip to a dlrover-master process for each call a reader makes per range: lease
  ranges (FetchStreamShards), mark a range (MarkStream), report it done (ReportStreamDone),
  and the position (StreamPositionAt, what state_dict() costs).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.sharding import GrpcMaster  # noqa: E402
from tests.kafka_broker import KafkaBroker, kafka_missing  # noqa: E402


def first_record(consumer: object, want: int) -> float:
    """Seconds until ``consumer`` delivers the record at offset ``want``."""
    start = time.perf_counter()
    while True:
        for message in consumer.consume(num_messages=1, timeout=1.0):  # type: ignore[attr-defined]
            if message.error() is None:
                assert message.offset() == want, (message.offset(), want)
                return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, default=1024, help="records of one range")
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    missing = kafka_missing()
    if missing:
        sys.exit(f"cannot run: {missing}")
    from confluent_kafka import Consumer, TopicPartition

    from dlrover.client.sharding import connect
    from dlrover.sharding.stream import StreamMark, StreamSpec

    total = args.records * (args.rounds + 2) * 2
    ms: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        broker = KafkaBroker(Path(tmp))
        master = GrpcMaster()
        try:
            broker.create_topic("prof", 1)
            broker.produce("prof", [(0, b"x" * 100)] * total)
            consumer = Consumer(
                {
                    "bootstrap.servers": broker.bootstrap,
                    "group.id": "prof",
                    "enable.auto.commit": False,
                }
            )
            consumer.assign([TopicPartition("prof", 0, 0)])
            first_record(consumer, 0)
            for i in range(1, args.rounds + 1):
                at = i * args.records * 2
                consumer.assign([TopicPartition("prof", 0, at)])
                ms.setdefault("assign() -> first record", []).append(first_record(consumer, at))
                consumer.seek(TopicPartition("prof", 0, at + 7))
                ms.setdefault("seek() -> first record", []).append(first_record(consumer, at + 7))
                start, got = time.perf_counter(), 0
                while got < args.records:
                    got += len(consumer.consume(num_messages=500, timeout=1.0))
                ms.setdefault(f"reading on: {args.records} records", []).append(
                    time.perf_counter() - start
                )
            consumer.close()
            transport = connect(master.addr, master.token)
            spec = StreamSpec(
                name="prof", records_per_shard=args.records, topic="prof",
                bootstrap_servers=broker.bootstrap, end_offsets=((0, total),),
            )  # fmt: skip
            transport.register_stream(spec)
            begin = 0
            for _ in range(args.rounds):
                t = time.perf_counter()
                (shard,) = transport.fetch_stream_shards("prof", "w/0", 1).shards
                ms.setdefault("master: lease a range", []).append(time.perf_counter() - t)
                t = time.perf_counter()
                mark = StreamMark(begin, shard.partition, shard.start, shard.end - shard.start)
                transport.mark_stream("prof", "w/0", mark)
                ms.setdefault("master: mark it", []).append(time.perf_counter() - t)
                begin += shard.end - shard.start
                t = time.perf_counter()
                transport.report_stream_done("prof", "w/0", [(shard.partition, shard.start)])
                ms.setdefault("master: report it done", []).append(time.perf_counter() - t)
                t = time.perf_counter()
                transport.stream_position_at("prof", begin)
                ms.setdefault("master: the position (state_dict)", []).append(
                    time.perf_counter() - t
                )
        finally:
            master.close()
            broker.stop()
    print(f"median of {args.rounds}, 100 B records, broker and master on loopback\n")
    print(f"| {'step':40} | {'ms':>7} |")
    print(f"|{'-' * 42}|{'-' * 9}|")
    for name, values in ms.items():
        print(f"| {name:40} | {statistics.median(values) * 1000:7.2f} |")


if __name__ == "__main__":
    main()
