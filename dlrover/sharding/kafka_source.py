"""A StreamSource over a Kafka topic: the master learns its partitions and how far each has grown
from the broker (``pip install 'dlrover[kafka]'``: confluent-kafka)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from dlrover.sharding.errors import ShardingError

log = logging.getLogger(__name__)

DEFAULT_BROKER_TIMEOUT_S = 10.0
"""Deadline of one metadata or offsets request to the broker."""
DEFAULT_REFRESH_S = 1.0
"""End offsets are asked of the broker at most this often; between, the last answer serves."""


class StreamSourceError(ShardingError):
    """The broker cannot be reached, or the topic does not exist; the message says which and
    what to check."""


class KafkaStreamSource:
    """Partitions and end offsets of ``topic`` on the brokers ``bootstrap_servers``.

    The partitions are read once (a stream's shards are cut per partition). End offsets (the
    high watermarks) are refreshed at most every ``refresh_s``; while the broker does not answer,
    the last known ones stand (no new shards, none lost) and a warning says so, once per outage.
    ``consumer_factory`` builds the client (tests; default confluent_kafka.Consumer).
    """

    def __init__(
        self,
        topic: str,
        bootstrap_servers: str,
        timeout_s: float = DEFAULT_BROKER_TIMEOUT_S,
        refresh_s: float = DEFAULT_REFRESH_S,
        consumer_factory: Callable[[dict[str, Any]], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not topic or not bootstrap_servers:
            raise StreamSourceError("a Kafka stream needs a topic and bootstrap_servers")
        self.topic = topic
        self.bootstrap_servers = bootstrap_servers
        self._timeout_s = timeout_s
        self._refresh_s = refresh_s
        self._clock = clock
        if consumer_factory is None:
            try:
                from confluent_kafka import Consumer
            except ImportError as exc:
                raise StreamSourceError(
                    "Kafka streams need confluent-kafka: pip install 'dlrover[kafka]'"
                ) from exc
            consumer_factory = Consumer
        # The master only reads metadata: no group membership, nothing consumed or committed.
        self._consumer = consumer_factory(
            {
                "bootstrap.servers": bootstrap_servers,
                "group.id": f"dlrover-master-{topic}",
                "enable.auto.commit": False,
                "socket.timeout.ms": int(timeout_s * 1000),
            }
        )
        self._lock = threading.Lock()
        self._partitions = self._read_partitions()
        self._ends: dict[int, int] = {p: 0 for p in self._partitions}
        self._refreshed_at: float | None = None
        self._outage = False

    def _read_partitions(self) -> list[int]:
        try:
            metadata = self._consumer.list_topics(self.topic, timeout=self._timeout_s)
        except Exception as exc:  # KafkaException: broker down, bad address...
            raise StreamSourceError(
                f"cannot reach the Kafka brokers {self.bootstrap_servers} within "
                f"{self._timeout_s:.0f}s to read topic {self.topic!r}: {exc}; check that they run "
                f"and that this machine can connect to them"
            ) from exc
        topic = metadata.topics.get(self.topic)
        if topic is None or topic.error is not None or not topic.partitions:
            why = topic.error if topic is not None and topic.error is not None else "no partitions"
            raise StreamSourceError(
                f"Kafka topic {self.topic!r} on {self.bootstrap_servers} is not usable ({why}); "
                f"create it first (e.g. kafka-topics.sh --create --topic {self.topic})"
            )
        return sorted(topic.partitions)

    def partitions(self) -> Sequence[int]:
        """The topic's partition numbers, as read when the source was created."""
        return list(self._partitions)

    def end_offset(self, partition: int) -> int:
        """One past the newest record of ``partition`` the broker reported (at most
        ``refresh_s`` old; the last known value while the broker is unreachable)."""
        with self._lock:
            now = self._clock()
            if self._refreshed_at is None or now - self._refreshed_at >= self._refresh_s:
                self._refreshed_at = now
                self._refresh()
            return self._ends[partition]

    def _refresh(self) -> None:
        from confluent_kafka import TopicPartition

        try:
            ends = {
                p: int(
                    self._consumer.get_watermark_offsets(
                        TopicPartition(self.topic, p), timeout=self._timeout_s
                    )[1]
                )
                for p in self._partitions
            }
        except Exception as exc:  # the broker went away: keep the last offsets
            if not self._outage:
                log.warning(
                    "Kafka brokers %s do not answer (%s); stream %r gets no new records until "
                    "they do",
                    self.bootstrap_servers,
                    exc,
                    self.topic,
                )
            self._outage = True
            return
        if self._outage:
            log.info("Kafka brokers %s answer again", self.bootstrap_servers)
        self._outage = False
        for p, end in ends.items():
            self._ends[p] = max(self._ends[p], end)

    def close(self) -> None:
        """Close the broker connection."""
        self._consumer.close()
