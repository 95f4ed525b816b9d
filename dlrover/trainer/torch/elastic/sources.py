"""Where an ElasticStreamDataset's records come from: the source interface, and Kafka's.

A source tells the master what its stream looks like (``stream_fields``: a Kafka topic the
master asks for its partitions and end offsets, or the end offsets of a bounded source known
at registration) and reads, in a worker, the records of the offset ranges the master leases it
(``open``). Everything else (leases, marks, exactly once with the checkpoint, at most once)
is the stream dataset's and the master's, whatever the source. `KafkaSource` reads a topic;
`dlrover.trainer.torch.elastic.ray_source.RayDataSource` reads a Ray Data dataset.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

from dlrover.sharding.errors import StreamSourceError
from dlrover.sharding.kafka_source import DEFAULT_RECONNECT_BACKOFF_MS
from dlrover.sharding.stream import StreamShard, StreamSpec
from dlrover.trainer.torch.elastic.kafka_reader import RangeReader, Records

FETCH_QUEUE_BACKOFF_MS = 1
"""librdkafka's ``fetch.queue.backoff.ms`` for the reader (its default: 1000)."""
KEEP_PER_PARTITION = 65536
"""Records of a partition the reader keeps, delivered while it read others, before it pauses
that partition (a resumed partition waits for a fetch: with 8 ranges' worth kept, a reader of
three partitions paused and resumed ~200 times per 300 k records and read ~25% slower).
librdkafka itself queues up to 100 k records per partition (queued.min.messages)."""
KEEP_BYTES_PER_PARTITION = 16 << 20
"""Bytes of record values of a partition the reader keeps before it pauses it, if that comes
before KEEP_PER_PARTITION records (records of 1 KiB: 16 k of them)."""


class RecordReader(Protocol):
    """Reads the records of leased offset ranges in one worker."""

    def prepare(self, shards: list[StreamShard]) -> None:
        """The ranges leased next (the reader may start fetching them)."""
        ...

    def read(
        self,
        shard: StreamShard,
        stopped: Callable[[], bool],
        timeout_s: float,
        poll_s: float,
        keep_alive: Callable[[], None],
    ) -> Records:
        """The records of ``shard``'s range in offset order (none more once ``stopped()``);
        StreamSourceError when they do not come within ``timeout_s``. ``keep_alive`` is called
        while it waits (the leases stay renewed)."""
        ...

    def close(self) -> None:
        """Release what the reader holds (connections)."""
        ...


class RecordSource(Protocol):
    """A stream's source, as an ElasticStreamDataset uses it in every rank."""

    name: str
    """What names the source in logs and the checkpointed state (a topic, a dataset name); the
    stream's name by default."""

    def stream_fields(self) -> dict[str, Any]:
        """The StreamSpec fields that tell the master the source: ``topic`` and
        ``bootstrap_servers``, or ``end_offsets`` of a source bounded at registration."""
        ...

    def open(self, spec: StreamSpec, whole_records: bool) -> RecordReader:
        """A reader for this worker; ``whole_records``: the decode needs more than the values
        (Kafka's keys and timestamps)."""
        ...

    def samples(
        self, partition: int, records: Records, decode: Callable[[Any], Any] | None
    ) -> list[Any]:
        """The samples of one range's ``records``: ``decode`` of each record, or (None) the
        records' values as they are."""
        ...


class KafkaRecord(NamedTuple):
    """One record of the topic, as the reader got it from the broker (a named tuple: built
    for every record, it costs a tenth of a frozen dataclass)."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int


class KafkaSource:
    """The records of a Kafka topic, each range read with ``assign()`` (no consumer-group
    rebalancing) by a `RangeReader`; ``consumer_config`` adds to or overrides the reader's
    librdkafka settings."""

    def __init__(
        self,
        topic: str,
        bootstrap_servers: str,
        *,
        consumer_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.name = topic
        self.topic = topic
        self.bootstrap_servers = bootstrap_servers
        self.consumer_config = dict(consumer_config or {})

    def stream_fields(self) -> dict[str, Any]:
        """The topic and brokers: the master reads the partitions and end offsets there."""
        return {"topic": self.topic, "bootstrap_servers": self.bootstrap_servers}

    def open(self, spec: StreamSpec, whole_records: bool) -> RangeReader:
        """A consumer that never joins the group nor commits (the master commits)."""
        try:
            from confluent_kafka import Consumer
        except ImportError as exc:
            raise StreamSourceError(
                "ElasticStreamDataset needs confluent-kafka: pip install 'dlrover[kafka]'"
            ) from exc
        config: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap_servers,
            # assign() only: the reader never joins the group, never commits.
            "group.id": f"{spec.commit_group}-reader",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "reconnect.backoff.ms": DEFAULT_RECONNECT_BACKOFF_MS,
            # The reader takes one partition's range at a time while the others' records
            # wait in the client's queue; a partition whose queue is over librdkafka's
            # thresholds is fetched again only after this backoff, by default a second: a
            # stall of ~1 s every few ranges (a long stream read 3-5x slower, measured).
            "fetch.queue.backoff.ms": FETCH_QUEUE_BACKOFF_MS,
        }
        config.update(self.consumer_config)
        records = max(spec.records_per_shard, spec.max_records_per_shard)  # the largest range
        return RangeReader(
            Consumer(config),
            self.topic,
            self.bootstrap_servers,
            skip_limit=2 * records,
            buffer_limit=max(8 * records, KEEP_PER_PARTITION),
            buffer_bytes=KEEP_BYTES_PER_PARTITION,
            full=whole_records,
        )

    def samples(
        self, partition: int, records: Records, decode: Callable[[Any], Any] | None
    ) -> list[Any]:
        """Each record's value bytes, or ``decode`` of a KafkaRecord built for it."""
        if decode is None:  # the value is the sample: no record to build
            return records.values
        return [
            decode(KafkaRecord(partition, offset, key, value, timestamp))
            for offset, value, key, timestamp in records.rows()
        ]
