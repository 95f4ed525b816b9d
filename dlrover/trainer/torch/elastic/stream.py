"""ElasticStreamDataset: online learning from a Kafka topic, exactly once with the checkpoint."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from torch.utils.data import IterableDataset, get_worker_info

from dlrover.client.sharding_transport import StreamTransport
from dlrover.client.stream_client import StreamShardingClient
from dlrover.constants import ENV_MASTER_ADDR
from dlrover.sharding.errors import (
    InvalidPositionError,
    InvalidSpecError,
    ShardingError,
    StreamSourceError,
)
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

DEFAULT_RECORDS_PER_SHARD = 1024
"""Records of one partition leased as one shard."""
DEFAULT_READ_TIMEOUT_S = 60.0
"""Longest the reader waits for the broker to deliver records the master said exist."""
DEFAULT_POLL_S = 1.0
"""One wait for new records of the topic; the reader waits again until ``idle_timeout_s``."""
READ_AHEAD_SHARDS = 2
"""Ranges read from the broker ahead of the training loop (memory: this many ranges' records)."""
_WAITING_LOG_EVERY_S = 30.0
_CONSUME_BATCH = 100
"""Records asked of the client at once: small, so the reader thread lets go of the GIL often
and the training loop never waits long for it."""


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
        self._pass: _ReadAhead | None = None

    # --- reading ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[T]:
        if get_worker_info() is not None:
            raise InvalidSpecError(
                "ElasticStreamDataset reads in the training process: use DataLoader(..., "
                "num_workers=0) (the Kafka client reads in threads of its own)"
            )
        self._end_pass()
        self.client.start()
        self._yielded = 0  # a new pass; the master learns it from its first mark (begin 0)
        reading = _ReadAhead(self)
        self._pass = reading
        try:
            while True:
                item = reading.next_item()
                if item is None:
                    return
                shard, messages = item
                for yielded, message in enumerate(messages, 1):
                    self._yielded += 1
                    record = KafkaRecord(
                        shard.partition,
                        message.offset(),
                        message.key(),
                        message.value(),
                        message.timestamp()[1],
                    )
                    # Where a pass closed here would stand: in case it is not resumed.
                    reading.taken = (shard, record.offset + 1, yielded)
                    yield self.decode(record)
                reading.finished(shard)
        finally:
            reading.close(self._yielded)
            if self._pass is reading:
                self._pass = None

    def _end_pass(self) -> None:
        if self._pass is not None:
            self._pass.close(self._yielded)
            self._pass = None

    def _read(self, shard: StreamShard, stop: threading.Event) -> Iterator[Any]:
        """The messages of ``shard``'s offset range, in order (none more once ``stop`` is set):
        the client's own objects, made into KafkaRecords by the loop (so the reader thread holds
        the GIL as little as it can). Offsets may have gaps (transaction markers, compaction,
        retention): the range is read once the consumer is past its end. Raises
        StreamSourceError when the broker does not deliver them within ``read_timeout_s``."""
        from confluent_kafka import KafkaError, TopicPartition

        consumer = self._reader()
        consumer.assign([TopicPartition(self.topic, shard.partition, shard.start)])
        expected = shard.start
        deadline = time.monotonic() + self.read_timeout_s
        last_error = ""
        while expected < shard.end and not stop.is_set():
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
                num_messages=min(_CONSUME_BATCH, shard.end - expected),
                timeout=min(remaining, self.poll_s),
            )
            for message in batch:
                error = message.error()
                if error is not None:
                    if error.code() != KafkaError._PARTITION_EOF:
                        last_error = str(error)
                    continue
                offset = message.offset()
                if offset >= shard.end:
                    expected = shard.end  # a later record: none is left below the end
                    break
                if offset < expected:
                    continue
                expected = offset + 1
                deadline = time.monotonic() + self.read_timeout_s
                yield message
            if expected < shard.end and _past(consumer, self.topic, shard):
                expected = shard.end
            self.client.keep_alive()  # a slow broker must not cost the leases

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
        self._end_pass()
        self.client.restore_position(position, restore_token(position.to_dict()))
        self._yielded = 0

    def stop(self) -> None:
        """End the stream for every rank once the ranges being read are done."""
        self.client.stop()

    def close(self) -> None:
        """End the current pass and close the broker connection."""
        self._end_pass()
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None


class _End:
    """Queue marker: the pass has ended (the stream's end, a stop, or the idle timeout)."""


_Item = tuple[StreamShard, list[Any]]
"""A range and its messages (confluent_kafka.Message)."""


class _ReadAhead:
    """One pass over the stream: a thread leases ranges, reads each whole from the broker, marks
    it and queues it, up to READ_AHEAD_SHARDS ahead of the training loop, and reports the ranges
    the loop has yielded as done. The loop then never waits on the master or the broker while
    records are queued. Records are yielded in queue order, so the thread knows where each range
    begins in the pass (its mark) before the loop reaches it; a mark ahead is a range not trained
    yet, which is what a position at an earlier step must say."""

    def __init__(self, dataset: ElasticStreamDataset[Any]) -> None:
        self.dataset = dataset
        self.client = dataset.client
        self._items: queue.Queue[_Item | _End | BaseException] = queue.Queue(READ_AHEAD_SHARDS)
        self._done: queue.Queue[StreamShard | None] = queue.Queue()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.taken: tuple[StreamShard, int, int] | None = None
        """The range the loop is in: (range, first offset not yielded, records yielded)."""
        self._unread: list[StreamShard] = []
        """Ranges the thread leased but did not queue (the pass was closed meanwhile)."""
        self._ended = False
        self._closed_after = 0
        self._thread = threading.Thread(
            target=self._run, name=f"stream-reader-{dataset.topic}", daemon=True
        )
        self._thread.start()

    def next_item(self) -> _Item | None:
        """The next range and its records; None once the pass has ended. Raises what the thread
        met (StreamSourceError for a broker that does not deliver, a ShardingError...)."""
        while True:
            # Waiting for records is the point of an unbounded stream; the thread ends the
            # wait with END (end, stop, idle timeout) or an error, and is checked on.
            try:
                item = self._items.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive():
                    raise ShardingError(
                        f"the reader of topic {self.dataset.topic!r} ended without a word"
                    ) from None
        self._wake.set()  # there is room in the queue now
        if isinstance(item, _End):
            return None
        if isinstance(item, BaseException):
            raise item
        self.taken = (item[0], item[0].start, 0)
        return item

    def finished(self, shard: StreamShard) -> None:
        """The loop has yielded every record of ``shard``."""
        self.taken = None
        self._done.put(shard)
        self._wake.set()

    def close(self, yielded: int) -> None:
        """Stop reading ahead after the loop yielded ``yielded`` records. The ranges the loop
        finished are reported before the thread ends; those it did not (all of a queued range,
        the rest of the one it was in) go back to the master, to be leased again first."""
        self._closed_after = yielded
        self._done.put(None)
        self._stop.set()
        self._wake.set()
        self._thread.join(self.dataset.read_timeout_s + 5.0)

    def _run(self) -> None:
        try:
            self._read_ahead()
        except BaseException as error:  # the loop raises it: a failure must not vanish
            self._put(error)
        # Report what the loop finishes until it closes the pass; the ranges it still trains
        # stay leased meanwhile.
        while True:
            try:
                shard = self._done.get(timeout=1.0)
            except queue.Empty:
                self.client.keep_alive()
                continue
            if shard is None:
                break
            self._report(shard)
        self._report_finished()
        self._give_back()

    def _give_back(self) -> None:
        remainders = [] if self.taken is None else [self.taken]
        remainders += [(shard, shard.start, 0) for shard in self._unread]
        while True:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, tuple):
                remainders.append((item[0], item[0].start, 0))
        if self._ended and not remainders and not self.client.leased_ahead():
            return  # the loop read the whole pass
        try:
            self.client.give_back(remainders)
            # The pass ended here: a position at this count must not wait for more.
            self.client.mark(StreamMark(self._closed_after))
        except Exception as error:  # the ranges stay leased until their lease runs out
            logger.warning("could not give back the unread ranges %s: %s", remainders, error)

    def _read_ahead(self) -> None:
        dataset, client = self.dataset, self.client
        begin = 0
        idle_since = logged = time.monotonic()
        while not self._stop.is_set():
            self._report_finished()
            shard = client.poll(dataset.poll_s)
            if shard is None:
                now = time.monotonic()
                if client.finished:
                    break
                if (
                    dataset.idle_timeout_s is not None
                    and now - idle_since >= dataset.idle_timeout_s
                ):
                    logger.info(
                        "no new record of %r for %.0fs: ending", dataset.topic, now - idle_since
                    )
                    break
                if now - logged >= _WAITING_LOG_EVERY_S:
                    logger.info("waiting for new records of topic %r", dataset.topic)
                    logged = now
                continue
            messages = list(dataset._read(shard, self._stop))
            if self._stop.is_set():
                self._unread.append(shard)
                return
            if not client.mark(StreamMark(begin, shard.partition, shard.start, len(messages))):
                # Another worker may hold it now: yielding it would train it twice.
                logger.warning("lost the lease on %s while reading it: skipped", shard)
                continue
            begin += len(messages)
            if not self._put((shard, messages)):
                self._unread.append(shard)
                return
            idle_since = time.monotonic()
        client.mark(StreamMark(begin))  # this pass has ended after `begin` records
        self._ended = True
        self._put(_End())

    def _put(self, item: _Item | _End | BaseException) -> bool:
        """Queue ``item`` once there is room (the loop takes items as it trains); False if the
        pass was closed meanwhile. Reports finished ranges as the loop finishes them, and keeps
        the leases alive, while it waits."""
        while not self._stop.is_set():
            self._wake.clear()
            self._report_finished()
            try:
                self._items.put_nowait(item)
                return True
            except queue.Full:
                pass
            self._wake.wait(1.0)  # set when the loop takes an item or finishes a range
            self.client.keep_alive()
        return False

    def _report_finished(self) -> None:
        while True:
            try:
                shard = self._done.get_nowait()
            except queue.Empty:
                return
            if shard is None:
                self._done.put(None)  # keep the close marker for _run
                return
            self._report(shard)

    def _report(self, shard: StreamShard) -> None:
        try:
            self.client.report_done(shard)
        except Exception as error:  # the range stays leased; its lease or a restore settles it
            logger.warning("could not report %s done: %s", shard, error)


def _past(consumer: Any, topic: str, shard: StreamShard) -> bool:
    """Whether ``consumer`` is past the end of ``shard`` though it delivered no record at or
    after it: the last offsets of the range hold no record (a transaction's marker moves the
    position past it) or were deleted (the oldest offset kept is at or past the end)."""
    from confluent_kafka import KafkaException, TopicPartition

    partition = TopicPartition(topic, shard.partition)
    try:
        (position,) = consumer.position([partition])
        oldest, _ = consumer.get_watermark_offsets(partition, cached=True)
    except KafkaException:
        return False
    return max(position.offset, oldest) >= shard.end


def _transport_from_env() -> StreamTransport:
    address = os.environ.get(ENV_MASTER_ADDR, "")
    if not address:
        raise InvalidSpecError(
            f"ElasticStreamDataset needs the job master, which shares the topic among the ranks: "
            f"run the script with dlrover-run (it sets {ENV_MASTER_ADDR}), or pass transport="
        )
    from dlrover.client.sharding import connect

    return connect(address)
