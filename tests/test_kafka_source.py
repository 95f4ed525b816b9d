"""KafkaStreamSource against a real Kafka-protocol broker: partitions and end offsets come from
the broker, a stream queue over it leases every record once, an outage is ridden out."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlrover.sharding.stream import StreamQueue, StreamSpec
from tests.kafka_broker import KafkaBroker, kafka_missing

pytestmark = [
    pytest.mark.extras,
    pytest.mark.skipif(bool(kafka_missing()), reason=kafka_missing() or "ok"),
]


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[KafkaBroker]:
    b = KafkaBroker(tmp_path)
    try:
        yield b
    finally:
        b.stop()


def test_partitions_and_end_offsets_come_from_the_broker_and_grow(broker: KafkaBroker) -> None:
    from dlrover.sharding.kafka_source import KafkaStreamSource

    broker.create_topic("clicks", 3)
    broker.produce("clicks", [(i % 3, f"r{i}".encode()) for i in range(30)])
    source = KafkaStreamSource("clicks", broker.bootstrap, refresh_s=3600.0)
    try:
        assert list(source.partitions()) == [0, 1, 2]
        assert [source.end_offset(p) for p in range(3)] == [10, 10, 10]
        broker.produce("clicks", [(1, b"late")] * 5)
        assert source.end_offset(1) == 10  # answered from memory until the next refresh
        assert source.refresh()
        assert source.end_offset(1) == 15

        # A stream queue over it cuts every record into exactly one leased range.
        queue = StreamQueue(StreamSpec("clicks", records_per_shard=4), source)
        shards = queue.fetch("w0", 100, now=0.0).shards
        covered = sorted((s.partition, o) for s in shards for o in range(s.start, s.end))
        assert covered == sorted((p, o) for p, n in ((0, 10), (1, 15), (2, 10)) for o in range(n))
    finally:
        source.close()


def test_an_unreachable_broker_or_a_missing_topic_is_a_clear_error(broker: KafkaBroker) -> None:
    from dlrover.sharding.kafka_source import KafkaStreamSource, StreamSourceError

    with pytest.raises(StreamSourceError, match="topic 'nope'.*create it first"):
        KafkaStreamSource("nope", broker.bootstrap, timeout_s=5)
    broker.stop()
    with pytest.raises(StreamSourceError, match="cannot reach the Kafka brokers"):
        KafkaStreamSource("clicks", broker.bootstrap, timeout_s=2)


def test_while_the_broker_is_down_the_last_end_offsets_stand(
    broker: KafkaBroker, caplog: pytest.LogCaptureFixture
) -> None:
    from dlrover.sharding.kafka_source import KafkaStreamSource

    broker.create_topic("t", 2)
    broker.produce("t", [(0, b"a"), (1, b"b"), (1, b"c")])
    source = KafkaStreamSource("t", broker.bootstrap, timeout_s=2, refresh_s=3600.0)
    try:
        assert [source.end_offset(0), source.end_offset(1)] == [1, 2]
        broker.stop()
        assert not source.refresh()
        assert [source.end_offset(0), source.end_offset(1)] == [1, 2]
        assert "do not answer" in caplog.text
    finally:
        source.close()


def test_a_source_closed_soon_after_an_outage_still_commits_its_last_offsets(
    broker: KafkaBroker,
) -> None:
    """The refresher last saw the broker down; it is back when the job ends: the final commit
    asks it again instead of leaving the offsets uncommitted."""
    from confluent_kafka import Consumer, TopicPartition

    from dlrover.sharding.kafka_source import KafkaStreamSource

    broker.create_topic("t", 2)
    broker.produce("t", [(0, b"a"), (1, b"b"), (1, b"c")])
    source = KafkaStreamSource("t", broker.bootstrap, group_id="g", timeout_s=2, refresh_s=3600)
    try:
        broker.stop(graceful=True)
        assert not source.refresh()  # the outage is seen
        broker.start()
        source.commit({0: 1, 1: 2})
    finally:
        source.close()
    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "g"})
    try:
        parts = [TopicPartition("t", p) for p in (0, 1)]
        assert [tp.offset for tp in consumer.committed(parts, timeout=10)] == [1, 2]
    finally:
        consumer.close()


def test_a_source_closed_while_the_broker_is_down_returns_within_its_timeout(
    broker: KafkaBroker,
) -> None:
    """The last commit waits for the group's coordinator at most the source's timeout (it
    waited librdkafka's 45 s session timeout, and a stopping master with it)."""
    from dlrover.sharding.kafka_source import KafkaStreamSource

    broker.create_topic("t", 2)
    source = KafkaStreamSource("t", broker.bootstrap, group_id="g", timeout_s=2, refresh_s=3600)
    source.commit({0: 0, 1: 0})
    assert source.flush_commit()  # the group's coordinator is known
    source.commit({0: 1, 1: 1})
    broker.stop(graceful=True)
    began = time.monotonic()
    source.close()
    assert time.monotonic() - began < 2 * 2 + 2  # a refresh and a commit, each bounded
