"""RangeReader against a real Kafka-protocol broker: every range read gives exactly its records,
whether the consumer goes on, reads through a few records, or is re-positioned."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dlrover.sharding.stream import StreamShard
from tests.kafka_broker import KafkaBroker, kafka_missing

pytestmark = [
    pytest.mark.extras,
    pytest.mark.skipif(bool(kafka_missing()), reason=kafka_missing() or "ok"),
]


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[KafkaBroker]:
    (tmp_path / "broker").mkdir()
    b = KafkaBroker(tmp_path / "broker")
    try:
        yield b
    finally:
        b.stop()


def _consumer(broker: KafkaBroker, group: str) -> Any:
    """A plain consumer of ``broker``, as ElasticStreamDataset makes (assign() only)."""
    from confluent_kafka import Consumer

    return Consumer(
        {
            "bootstrap.servers": broker.bootstrap,
            "group.id": group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )


def test_each_range_reads_exactly_its_records_in_every_way_the_consumer_gets_there(
    broker: KafkaBroker,
) -> None:
    from dlrover.trainer.torch.elastic.kafka_reader import RangeReader

    broker.create_topic("clicks", 2)
    for partition in range(2):
        broker.produce("clicks", [(partition, f"{partition}:{i}".encode()) for i in range(60)])
    consumer = _consumer(broker, "reader-test")
    reader = RangeReader(consumer, "clicks", broker.bootstrap, skip_limit=8, buffer_limit=4)
    try:
        # (partition, start, end), chosen to take each path: first range of a partition, the
        # next one going on, a small gap read through, a gap too large (re-positioned), a range
        # behind the consumer (re-positioned), and ranges of a partition paused meanwhile.
        ranges = [
            (0, 0, 10),
            (1, 0, 10),
            (0, 10, 20),
            (0, 25, 30),
            (0, 45, 50),
            (0, 5, 15),
            (1, 10, 20),
            (1, 20, 60),
            (0, 15, 60),
        ]
        for partition, start, end in ranges:
            shard = StreamShard("clicks", partition, start, end)
            reader.prepare([shard])
            records = reader.read(shard, lambda: False, 30.0, 1.0, lambda: None)
            assert records.offsets == list(range(start, end))
            assert records.values == [f"{partition}:{i}".encode() for i in range(start, end)]
    finally:
        reader.close()


class _Recording:
    """A consumer that records its pause() and resume() calls, partitions only."""

    def __init__(self, consumer: object) -> None:
        self.consumer = consumer
        self.calls: list[tuple[str, list[int]]] = []

    def pause(self, partitions: list) -> None:  # type: ignore[type-arg]
        self.calls.append(("pause", [tp.partition for tp in partitions]))
        self.consumer.pause(partitions)  # type: ignore[attr-defined]

    def resume(self, partitions: list) -> None:  # type: ignore[type-arg]
        self.calls.append(("resume", [tp.partition for tp in partitions]))
        self.consumer.resume(partitions)  # type: ignore[attr-defined]

    def incremental_unassign(self, partitions: list) -> None:  # type: ignore[type-arg]
        self.calls.append(("unassign", [tp.partition for tp in partitions]))
        self.consumer.incremental_unassign(partitions)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.consumer, name)


def test_a_partition_is_assigned_at_its_earliest_range_leased_so_reading_it_never_repositions(
    broker: KafkaBroker,
) -> None:
    """Several ranges of one partition among those prepared (a single-partition topic, or a
    larger prefetch): the partition is assigned at the first of them, so reading them in order
    goes on from the consumer's position, without a re-position (a fetch round trip each)."""
    from dlrover.trainer.torch.elastic.kafka_reader import RangeReader

    broker.create_topic("likes", 1)
    broker.produce("likes", [(0, f"0:{i}".encode()) for i in range(30)])
    consumer = _Recording(_consumer(broker, "reader-earliest-test"))
    reader = RangeReader(consumer, "likes", broker.bootstrap, skip_limit=8, buffer_limit=100)
    try:
        shards = [StreamShard("likes", 0, start, start + 10) for start in (0, 10, 20)]
        reader.prepare(shards)  # in lease order: the last of them must not decide
        for k, shard in enumerate(shards):
            reader.prepare(shards[k:])
            records = reader.read(shard, lambda: False, 30.0, 1.0, lambda: None)
            assert records.offsets == list(range(shard.start, shard.end))
        assert [call for call in consumer.calls if call[0] == "unassign"] == []
    finally:
        reader.close()


@pytest.mark.parametrize(
    ("limit", "limit_bytes"), [(4, None), (10_000, 4 * 1024)], ids=["records", "bytes"]
)
def test_a_paused_partition_is_resumed_when_its_range_is_leased_next_not_when_it_is_read(
    broker: KafkaBroker, limit: int, limit_bytes: int | None
) -> None:
    """A partition paused because its kept records passed the limit (a count, or bytes of 1 KiB
    values) fetches again as soon as a range of it is among the next ones (prepare), so its
    records are there when it is read; and it is not paused again meanwhile."""
    from dlrover.trainer.torch.elastic.kafka_reader import RangeReader

    def value(partition: int, i: int) -> bytes:
        return f"{partition}:{i}".encode().ljust(1024, b".")

    broker.create_topic("views", 2)
    for partition in range(2):
        broker.produce("views", [(partition, value(partition, i)) for i in range(400)])
    consumer = _Recording(_consumer(broker, "reader-resume-test"))
    reader = RangeReader(
        consumer,
        "views",
        broker.bootstrap,
        skip_limit=8,
        buffer_limit=limit,
        buffer_bytes=limit_bytes,
    )
    try:
        reader.prepare([StreamShard("views", 1, 0, 10)])  # assigned, then not read for a while
        for start in range(0, 400, 50):  # partition 1 is delivered meanwhile: past 4 kept
            shard = StreamShard("views", 0, start, start + 50)
            reader.prepare([shard])
            reader.read(shard, lambda: False, 30.0, 1.0, lambda: None)
            if ("pause", [1]) in consumer.calls:
                break
        assert ("pause", [1]) in consumer.calls
        consumer.calls.clear()
        shard = StreamShard("views", 1, 0, 400)
        reader.prepare([shard])
        assert consumer.calls == [("resume", [1])]
        records = reader.read(shard, lambda: False, 30.0, 1.0, lambda: None)
        assert records.values == [value(1, i) for i in range(400)]
        assert ("pause", [1]) not in consumer.calls
    finally:
        reader.close()
