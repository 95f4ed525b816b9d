"""ElasticStreamDataset: online learning from a Kafka topic, exactly once with the checkpoint."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from torch.utils.data import IterableDataset, get_worker_info

from dlrover.client.sharding_transport import StreamTransport
from dlrover.client.stream_client import StreamShardingClient
from dlrover.constants import ENV_MASTER_ADDR
from dlrover.sharding.errors import InvalidPositionError, InvalidSpecError, StreamSourceError
from dlrover.sharding.stream import StreamMark, StreamPosition, StreamShard, StreamSpec
from dlrover.trainer.torch.elastic.client_factory import (
    default_worker_id,
    lease_s_from_env,
    prefetch_from_env,
    restore_token,
)
from dlrover.worker_context import WorkerContext

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_RECORDS_PER_SHARD = 256
"""Records of one partition leased as one shard."""
DEFAULT_READ_TIMEOUT_S = 60.0
"""Longest the reader waits for the broker to deliver records the master said exist."""
DEFAULT_POLL_S = 1.0
"""One wait for new records of the topic; the reader waits again until ``idle_timeout_s``."""
_WAITING_LOG_EVERY_S = 30.0


@dataclass(frozen=True)
class KafkaRecord:
    """One record of the topic, as the reader got it from the broker."""

    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    timestamp_ms: int


def record_value(record: KafkaRecord) -> bytes | None:
    """The default ``decode``: the record's value bytes."""
    return record.value


class ElasticStreamDataset(IterableDataset[T], Generic[T]):
    """The records of a Kafka topic, shared among the job's ranks by the master, once each.

    The master splits every partition into offset ranges of ``records_per_shard`` and leases
    them to ranks as they ask (a fast rank reads more); each rank reads exactly its ranges with
    ``assign()`` (no consumer-group rebalancing). ``decode`` turns a KafkaRecord into a sample
    (default: its value bytes). Use it with a DataLoader whose ``num_workers`` is 0.

    Exactly once with the checkpoint: ``state_dict()`` is the position (per partition the
    offsets trained, and ranges not trained) when every rank had taken as many records as this
    one; call it on rank 0 alone or on every rank, no collective runs. ``load_state_dict`` on
    every rank resumes there: no record is trained twice or skipped. Finished offsets are also
    committed to the broker under ``group_id`` (default ``dlrover-<name>``) for Kafka's tools.

    The stream is unbounded: a rank that has read everything waits for new records (polls of
    at most ``poll_s``). It ends when the master's stream ends: at ``end_offsets`` (partition
    -> offset) or after ``stop()``; or, for this rank, after ``idle_timeout_s`` without a record.
    """

    def __init__(
        self,
        topic: str,
        bootstrap_servers: str,
        *,
        name: str | None = None,
        records_per_shard: int = DEFAULT_RECORDS_PER_SHARD,
        decode: Callable[[KafkaRecord], T] = record_value,  # type: ignore[assignment]
        end_offsets: Mapping[int, int] | None = None,
        group_id: str = "",
        idle_timeout_s: float | None = None,
        poll_s: float = DEFAULT_POLL_S,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        consumer_config: Mapping[str, Any] | None = None,
        transport: StreamTransport | None = None,
        worker_id: str | None = None,
    ) -> None:
        self.topic = topic
        self.bootstrap_servers = bootstrap_servers
        self.decode = decode
        self.idle_timeout_s = idle_timeout_s
        self.poll_s = poll_s
        self.read_timeout_s = read_timeout_s
        self.consumer_config = dict(consumer_config or {})
        self.spec = StreamSpec(
            name=name or topic,
            records_per_shard=records_per_shard,
            lease_s=lease_s_from_env(),
            topic=topic,
            bootstrap_servers=bootstrap_servers,
            group_id=group_id,
            end_offsets=tuple((end_offsets or {}).items()),
        )
        if transport is None:
            transport = _transport_from_env()
        ctx = WorkerContext.from_env()
        self.client = StreamShardingClient(
            transport, self.spec, worker_id or default_worker_id(ctx.rank), prefetch_from_env()
        )
        self._yielded = 0
        self._consumer: Any = None

    # --- reading ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[T]:
        if get_worker_info() is not None:
            raise InvalidSpecError(
                "ElasticStreamDataset reads in the training process: use DataLoader(..., "
                "num_workers=0) (the Kafka client reads in threads of its own)"
            )
        self.client.start()
        self._yielded = 0  # a new pass; the master learns it from its first mark (begin 0)
        idle_since = time.monotonic()
        logged = idle_since
        while True:
            shard = self.client.poll(self.poll_s)
            if shard is None:
                now = time.monotonic()
                if self.client.finished:
                    break
                if self.idle_timeout_s is not None and now - idle_since >= self.idle_timeout_s:
                    logger.info(
                        "no new record of %r for %.0fs: ending", self.topic, now - idle_since
                    )
                    break
                if now - logged >= _WAITING_LOG_EVERY_S:
                    logger.info("waiting for new records of topic %r", self.topic)
                    logged = now
                continue
            self.client.mark(StreamMark(self._yielded, shard.partition, shard.start))
            for record in self._read(shard):
                self._yielded += 1
                yield self.decode(record)
            self.client.report_done(shard)
            idle_since = time.monotonic()
        self.client.mark(StreamMark(self._yielded))  # this pass has ended

    def _read(self, shard: StreamShard) -> Iterator[KafkaRecord]:
        """The records of ``shard``'s offset range, in order. Raises StreamSourceError when the
        broker does not deliver them within ``read_timeout_s``."""
        from confluent_kafka import KafkaError, TopicPartition

        consumer = self._reader()
        consumer.assign([TopicPartition(self.topic, shard.partition, shard.start)])
        expected = shard.start
        deadline = time.monotonic() + self.read_timeout_s
        last_error = ""
        while expected < shard.end:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StreamSourceError(
                    f"the Kafka brokers {self.bootstrap_servers} did not deliver records "
                    f"[{expected}, {shard.end}) of topic {self.topic!r} partition "
                    f"{shard.partition} within {self.read_timeout_s:.0f}s"
                    f"{f' ({last_error})' if last_error else ''}. Check that they run; the "
                    f"training position is not lost: a restarted worker resumes from its "
                    f"checkpoint."
                )
            batch = consumer.consume(
                num_messages=min(500, shard.end - expected), timeout=min(remaining, self.poll_s)
            )
            for message in batch:
                error = message.error()
                if error is not None:
                    if error.code() != KafkaError._PARTITION_EOF:
                        last_error = str(error)
                    continue
                offset = message.offset()
                if offset < expected or offset >= shard.end:
                    continue  # read past the range (the fetch is per partition): not ours
                expected = offset + 1
                deadline = time.monotonic() + self.read_timeout_s
                timestamp = message.timestamp()[1]
                yield KafkaRecord(
                    shard.partition, offset, message.key(), message.value(), timestamp
                )

    def _reader(self) -> Any:
        if self._consumer is None:
            try:
                from confluent_kafka import Consumer
            except ImportError as exc:
                raise StreamSourceError(
                    "ElasticStreamDataset needs confluent-kafka: pip install 'dlrover[kafka]'"
                ) from exc
            config: dict[str, Any] = {
                "bootstrap.servers": self.bootstrap_servers,
                # assign() only: the reader never joins the group, never commits.
                "group.id": f"{self.spec.commit_group}-reader",
                "enable.auto.commit": False,
                "enable.auto.offset.store": False,
                "auto.offset.reset": "earliest",
            }
            config.update(self.consumer_config)
            self._consumer = Consumer(config)
        return self._consumer

    # --- checkpoint -------------------------------------------------------------------------
    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where to resume: the stream's position when every rank had taken ``consumed`` records
        in this pass (default: as many as this rank has taken; right after a step, with
        num_workers=0, that is every record the step trained). No collective runs."""
        count = self._yielded if consumed is None else consumed
        position = self.client.position_at(count)
        return {"topic": self.topic, "position": position.to_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a ``state_dict()``; every rank may call it (the master applies one
        checkpoint's position once per restart)."""
        if state.get("topic") != self.topic:
            raise InvalidPositionError(
                f"this stream state is of topic {state.get('topic')!r}, the dataset reads "
                f"{self.topic!r}"
            )
        position = StreamPosition.from_dict(dict(state["position"]))
        self.client.restore_position(position, restore_token(position.to_dict()))
        self._yielded = 0

    def stop(self) -> None:
        """End the stream for every rank once the ranges being read are done."""
        self.client.stop()

    def close(self) -> None:
        """Close the broker connection."""
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None


def _transport_from_env() -> StreamTransport:
    address = os.environ.get(ENV_MASTER_ADDR, "")
    if not address:
        raise InvalidSpecError(
            f"ElasticStreamDataset needs the job master, which shares the topic among the ranks: "
            f"run the script with dlrover-run (it sets {ENV_MASTER_ADDR}), or pass transport="
        )
    from dlrover.client.sharding import connect

    return connect(address)
