"""A StreamSource over a Kafka topic: the master learns its partitions and how far each has grown
from the broker (``pip install 'dlrover[kafka]'``: confluent-kafka)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from dlrover.sharding.errors import StreamSourceError
from dlrover.sharding.stream import StreamSpec

__all__ = ["KafkaStreamSource", "StreamSourceError", "kafka_source_for"]

log = logging.getLogger(__name__)

DEFAULT_BROKER_TIMEOUT_S = 10.0
"""Deadline of one metadata or offsets request to the broker."""
DEFAULT_REFRESH_S = 1.0
"""End offsets are asked of the broker at most this often; between, the last answer serves."""
DEFAULT_RECONNECT_BACKOFF_MS = 1000
"""librdkafka's wait before it dials a broker that refused again (the master's client and the
readers'). Its own default (100 ms) dialled a stopped broker about every 50 ms, each time
logging a ``Connect to ... failed`` line: 20 lines a second per client through an outage."""


class KafkaStreamSource:
    """Partitions and end offsets of ``topic`` on the brokers ``bootstrap_servers``.

    The partitions are read once (a stream's shards are cut per partition), unless
    ``partitions`` gives them (a restarted master knows them from its state and must not need
    the broker to start). A thread of the source asks the broker for the end offsets (high
    watermarks) every ``refresh_s`` and commits the offsets handed to ``commit`` under the
    consumer group ``group_id``; ``end_offset`` answers from memory, so no caller ever waits
    on the broker. While the broker does not answer, the last known offsets stand (no new
    shards, none lost) and a warning says so, once per outage. A new stream starts where the
    group's committed offsets stand, else at the oldest record the broker keeps.
    ``consumer_factory`` builds the client (tests; default confluent_kafka.Consumer).
    """

    def __init__(
        self,
        topic: str,
        bootstrap_servers: str,
        timeout_s: float = DEFAULT_BROKER_TIMEOUT_S,
        refresh_s: float = DEFAULT_REFRESH_S,
        consumer_factory: Callable[[dict[str, Any]], Any] | None = None,
        group_id: str = "",
        partitions: Sequence[int] | None = None,
    ) -> None:
        if not topic or not bootstrap_servers:
            raise StreamSourceError("a Kafka stream needs a topic and bootstrap_servers")
        self.topic = topic
        self.bootstrap_servers = bootstrap_servers
        self._timeout_s = timeout_s
        self._refresh_s = refresh_s
        if consumer_factory is None:
            try:
                from confluent_kafka import Consumer
            except ImportError as exc:
                raise StreamSourceError(
                    "Kafka streams need confluent-kafka: pip install 'dlrover[kafka]'"
                ) from exc
            consumer_factory = Consumer
        self.group_id = group_id or f"dlrover-{topic}"
        # The master reads metadata and commits offsets; it never subscribes, so it is no
        # member of the group and nothing rebalances.
        self._consumer = consumer_factory(
            {
                "bootstrap.servers": bootstrap_servers,
                "group.id": self.group_id,
                "enable.auto.commit": False,
                "socket.timeout.ms": int(timeout_s * 1000),
                # A commit waits for the group's coordinator up to the session timeout (45 s
                # by default: a master stopping while the broker was down blocked that long).
                # The master never joins the group, so the session is only this bound.
                "session.timeout.ms": max(int(timeout_s * 1000), 1000),
                "heartbeat.interval.ms": max(int(timeout_s * 1000), 1000) // 3,
                "reconnect.backoff.ms": DEFAULT_RECONNECT_BACKOFF_MS,
            }
        )
        self._lock = threading.Lock()
        self._outage = False
        self._wanted: dict[int, int] = {}
        self._committed: dict[int, int] = {}
        if partitions is None:
            self._partitions = self._read_partitions()
            self._ends: dict[int, int] = {p: 0 for p in self._partitions}
            self.refresh()  # the broker just answered: start with its offsets
        else:
            self._partitions = list(partitions)
            self._ends = {p: 0 for p in self._partitions}
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"kafka-offsets-{topic}", daemon=True
        )
        self._thread.start()

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

    def start_offset(self, partition: int) -> int:
        """The group's committed offset of ``partition``, else the oldest offset the broker
        keeps. Raises StreamSourceError when the broker does not answer."""
        from confluent_kafka import TopicPartition

        tp = TopicPartition(self.topic, partition)
        try:
            (committed,) = self._consumer.committed([tp], timeout=self._timeout_s)
            if committed.offset >= 0:
                return int(committed.offset)
            return int(self._consumer.get_watermark_offsets(tp, timeout=self._timeout_s)[0])
        except Exception as exc:
            raise StreamSourceError(
                f"cannot read where group {self.group_id!r} stands in topic {self.topic!r} "
                f"partition {partition} on {self.bootstrap_servers}: {exc}"
            ) from exc

    def end_offset(self, partition: int) -> int:
        """One past the newest record of ``partition`` the broker reported (at most about
        ``refresh_s`` old; the last known value while the broker is unreachable)."""
        with self._lock:
            return self._ends[partition]

    def commit(self, offsets: dict[int, int]) -> None:
        """Have ``offsets`` (partition -> first record not done) committed under the group by
        the source's thread; while the broker is down the newest ones wait for it."""
        with self._lock:
            self._wanted = dict(offsets)

    def refresh(self) -> bool:
        """Ask the broker for the end offsets now; False (the last ones stand) when it does not
        answer within the timeout."""
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
            return False
        if self._outage:
            log.info("Kafka brokers %s answer again", self.bootstrap_servers)
        self._outage = False
        with self._lock:
            for p, end in ends.items():
                self._ends[p] = max(self._ends[p], end)
        return True

    def flush_commit(self) -> bool:
        """Commit the newest offsets handed to ``commit`` now, waiting for the broker (at most
        the timeout); False when it refused or did not answer (the next round tries again)."""
        from confluent_kafka import TopicPartition

        with self._lock:
            wanted = dict(self._wanted)
        if not wanted or wanted == self._committed:
            return True
        try:
            self._consumer.commit(
                offsets=[TopicPartition(self.topic, p, o) for p, o in sorted(wanted.items())],
                asynchronous=False,
            )
        except Exception as exc:  # broker down: the offsets wait until it is back
            log.debug("cannot commit offsets of %r yet: %s", self.topic, exc)
            return False
        self._committed = wanted
        return True

    def _run(self) -> None:
        while not self._stop.wait(self._refresh_s):
            if self.refresh():
                self.flush_commit()

    def close(self) -> None:
        """Stop the refresher, commit the newest offsets a last time (outage or not), close the
        connection."""
        self._stop.set()
        self._thread.join(self._timeout_s * (len(self._partitions) + 2))
        # The last commit is tried even when the refresher last saw the broker down: a job
        # that ends soon after an outage finds it back, and a broker just back takes commits
        # before its metadata answers (a broker still down costs one request's timeout).
        if self._outage:
            self.refresh()
        self.flush_commit()
        self._consumer.close()


def kafka_source_for(
    spec: StreamSpec, partitions: Sequence[int] | None = None
) -> KafkaStreamSource:
    """The source a registered stream's spec names; ``partitions`` when they are already known
    (a restarted master). Raises StreamSourceError for a spec without a Kafka topic."""
    if not spec.topic:
        raise StreamSourceError(
            f"stream {spec.name!r} names no source: give a Kafka topic and bootstrap_servers, "
            f"or the end offsets of a bounded source (a Ray Data dataset's rows)"
        )
    return KafkaStreamSource(
        spec.topic, spec.bootstrap_servers, group_id=spec.commit_group, partitions=partitions
    )
