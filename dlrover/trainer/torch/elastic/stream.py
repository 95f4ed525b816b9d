"""ElasticStreamDataset: online learning from a stream (a Kafka topic, a Ray Data dataset),
exactly once with the checkpoint, or at most once."""

from __future__ import annotations

import itertools
import logging
import operator
import os
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from typing import Any, Generic, TypeVar

from torch.utils.data import IterableDataset, get_worker_info

from dlrover.client.sharding_transport import StreamTransport
from dlrover.client.stream_client import StreamShardingClient
from dlrover.constants import ENV_MASTER_ADDR
from dlrover.sharding.errors import (
    InvalidPositionError,
    InvalidSpecError,
    ShardingError,
)
from dlrover.sharding.stream import (
    StreamFetchResult,
    StreamMark,
    StreamPosition,
    StreamShard,
    StreamSpec,
)
from dlrover.sharding.types import DeliveryMode
from dlrover.trainer.torch.elastic.client_factory import (
    default_worker_id,
    delivery_mode,
    lease_s_from_env,
    prefetch_from_env,
    restore_token,
)
from dlrover.trainer.torch.elastic.kafka_reader import Records
from dlrover.trainer.torch.elastic.sources import (
    KafkaRecord,
    KafkaSource,
    RecordReader,
    RecordSource,
)
from dlrover.worker_context import WorkerContext

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_RECORDS_PER_SHARD = 1024
"""Records of a partition's first range when ``records_per_shard`` is not given."""
DEFAULT_MAX_RECORDS_PER_SHARD = 16384
"""What a partition's ranges grow to when ``records_per_shard`` is not given: each range costs
the master and the reader about 1.4 calls (lease, mark, report), ~1 ms of CPU on each side,
what reading ~1,000 records costs; at 16 k records a range, the calls are under 10 per 100 k
records."""
DEFAULT_READ_TIMEOUT_S = 60.0
"""Longest the reader waits for the broker to deliver records the master said exist."""
DEFAULT_POLL_S = 1.0
"""One wait for new records of the topic; the reader waits again until ``idle_timeout_s``."""
REPORT_EVERY = 8
"""Finished ranges reported in one call while the reader is busy (at once when it waits)."""
MARK_EVERY = 4
"""Ranges read marked in one call while the loop has ranges queued (every range when it has
none): each call costs the master and this process ~1 ms of CPU, what reading 1024 records
does."""
READ_AHEAD_SHARDS = 2
"""Ranges queued for the training loop. While the loop is behind (the queue full) the reader
holds one more, being handed over; while it keeps up, up to 2 x MARK_EVERY more may be read
and on their way (marks in flight, or waiting to be sent) for a moment."""
_WAITING_LOG_EVERY_S = 30.0


__all__ = ["ElasticStreamDataset", "KafkaRecord", "KafkaSource", "RecordSource", "record_value"]


def record_value(record: KafkaRecord) -> bytes | None:
    """The default ``decode``: the record's value bytes."""
    return record.value


class ElasticStreamDataset(IterableDataset[T], Generic[T]):
    """The records of a stream, shared among the job's ranks by the master, once each.

    ``ElasticStreamDataset(topic, bootstrap_servers)`` reads a Kafka topic (the same as
    ``ElasticStreamDataset(KafkaSource(topic, bootstrap_servers))``); any `RecordSource` may
    stand in its place, e.g. ``RayDataSource(ray_dataset, name=...)`` (the rows of a Ray Data
    dataset, preprocessed upstream by Ray). The master splits every partition into offset
    ranges and leases them to ranks as they ask (a fast rank reads more): by default a
    partition's first range is 1,024 records and each next one twice the last, up to 16,384
    (a bounded partition's last ranges stay small, so the ranks finish together); an explicit
    ``records_per_shard`` cuts every range at that size. Each rank reads exactly its ranges
    (Kafka: with ``assign()``, no consumer-group rebalancing). ``decode`` turns a record into a
    sample (Kafka: a KafkaRecord, default its value bytes; Ray Data: a row dict, default the
    row). Use it with a DataLoader whose ``num_workers`` is 0.

    Exactly once with the checkpoint: ``state_dict()`` is the position (per partition the
    offsets trained, and ranges not trained) when every rank had taken as many records as this
    one; call it on rank 0 alone or on every rank, no collective runs. ``load_state_dict`` on
    every rank resumes there: no record is trained twice or skipped. Finished offsets are also
    committed to the broker under ``group_id`` (default ``dlrover-<name>``) for Kafka's tools.

    The stream is unbounded: a rank that has read everything waits for new records (polls of
    at most ``poll_s``). It ends when the master's stream ends: at ``end_offsets`` (partition
    -> offset) or after ``stop()``; or, for this rank, after ``idle_timeout_s`` without a record.

    ``mode`` (default: DLROVER_DELIVERY_MODE, else ``exactly-once``): ``at-most-once`` never
    hands a record out twice: after a failure the ranges the lost rank held are dropped, and
    ``load_state_dict`` does not go back to the checkpoint's position; what the model never
    trained is counted on the master (`dlrover status`, the ``dlrover_data_lost`` metric,
    ``client.progress().lost_records``). ``at-least-once`` and ``exactly-once`` read alike here (the
    position restored with the checkpoint makes it exactly once).
    """

    def __init__(
        self,
        topic: str | RecordSource,
        bootstrap_servers: str = "",
        *,
        name: str | None = None,
        records_per_shard: int | None = None,
        decode: Callable[[Any], T] | None = None,
        end_offsets: Mapping[int, int] | None = None,
        group_id: str = "",
        idle_timeout_s: float | None = None,
        poll_s: float = DEFAULT_POLL_S,
        read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
        consumer_config: Mapping[str, Any] | None = None,
        transport: StreamTransport | None = None,
        worker_id: str | None = None,
        mode: DeliveryMode | str | None = None,
    ) -> None:
        if isinstance(topic, str):
            if not bootstrap_servers:
                raise InvalidSpecError(
                    f"ElasticStreamDataset({topic!r}): a Kafka topic needs bootstrap_servers; "
                    f"for another source pass it in the topic's place (e.g. RayDataSource)"
                )
            source: RecordSource = KafkaSource(
                topic, bootstrap_servers, consumer_config=consumer_config
            )
        else:
            if bootstrap_servers or consumer_config:
                raise InvalidSpecError(
                    "bootstrap_servers and consumer_config are a Kafka topic's: the source "
                    f"{topic.name!r} is given whole"
                )
            source = topic
        self.source = source
        self.topic = source.name
        """What names the source (the topic of a Kafka stream)."""
        self.bootstrap_servers = bootstrap_servers
        self.decode = decode
        if decode is record_value:  # the value is the sample: no record to build
            self.decode = None
        self.idle_timeout_s = idle_timeout_s
        self.poll_s = poll_s
        self.read_timeout_s = read_timeout_s
        own = source.stream_fields()
        fields = {"end_offsets": tuple((end_offsets or {}).items()), **own}
        if end_offsets is not None and "end_offsets" in own:
            raise InvalidSpecError(
                f"the source {source.name!r} is bounded by itself: end_offsets does not apply"
            )
        self.spec = StreamSpec(
            name=name or source.name,
            records_per_shard=records_per_shard or DEFAULT_RECORDS_PER_SHARD,
            max_records_per_shard=0 if records_per_shard else DEFAULT_MAX_RECORDS_PER_SHARD,
            lease_s=lease_s_from_env(),
            group_id=group_id,
            mode=delivery_mode(mode),
            **fields,
        )
        if transport is None:
            transport = _transport_from_env()
        ctx = WorkerContext.from_env()
        self.client = StreamShardingClient(
            transport, self.spec, worker_id or default_worker_id(ctx.rank), prefetch_from_env()
        )
        self._yielded = 0
        """Records yielded by the last pass (the current one counts in its _ReadAhead)."""
        self._consumer: RecordReader | None = None
        self._pass: _ReadAhead | None = None

    # --- reading ----------------------------------------------------------------------------
    def __iter__(self) -> Iterator[T]:
        with closing(self._ranges()) as ranges:
            for samples in ranges:
                # The samples were decoded by the reader thread; the loop's share per record
                # is one step of a list iterator, whose progress is the count `yielded` reads.
                yield from samples

    def batches(self, batch_size: int) -> Iterator[list[T]]:
        """A pass over the stream in lists of ``batch_size`` samples (the last one of a pass
        may be shorter), for a loop that needs no DataLoader: a batch is cut from the ranges
        the reader queued in one C-level step, where a DataLoader takes each sample with a
        Python call (0.1-0.2 ms per batch of 256 here). Exactly once as with iteration:
        right after a batch, ``state_dict()`` counts every record handed out so far.
        """
        if batch_size < 1:
            raise InvalidSpecError(f"batch_size must be >= 1, got {batch_size}")
        batch: list[T] = []
        with closing(self._ranges()) as ranges:
            try:
                for samples in ranges:
                    while True:
                        batch += itertools.islice(samples, batch_size - len(batch))
                        if len(batch) < batch_size:
                            break  # this range is used up: the rest comes from the next one
                        full, batch = batch, []
                        yield full
            except Exception:
                # Records taken into a batch count as handed out: the loop gets them before
                # the error, which it meets at its next batch.
                if batch:
                    yield batch
                raise
            if batch:
                yield batch

    def _ranges(self) -> Generator[Iterator[T], None, None]:
        """One pass: the samples of each range the reader queued, as an iterator whose progress
        is what this rank has taken (``state_dict`` counts it); take every sample of one
        before asking for the next."""
        if get_worker_info() is not None:
            raise InvalidSpecError(
                "ElasticStreamDataset reads in the training process: use DataLoader(..., "
                "num_workers=0) (the Kafka client reads in threads of its own)"
            )
        self._end_pass()
        self.client.start()
        self.client.begin_pass()
        self._yielded = 0  # a new pass; the master learns it from its first mark (begin 0)
        reading = _ReadAhead(self)
        self._pass = reading
        try:
            while True:
                item = reading.next_item()
                if item is None:
                    return
                yield reading.current(item)
                reading.finished(item[0])
        finally:
            self._yielded = reading.yielded()
            reading.close(self._yielded)
            if self._pass is reading:
                self._pass = None

    def _end_pass(self) -> None:
        if self._pass is not None:
            self._yielded = self._pass.yielded()
            self._pass.close(self._yielded)
            self._pass = None

    def _count(self) -> int:
        """Records yielded in the current (or last) pass."""
        reading = self._pass
        return reading.yielded() if reading is not None else self._yielded

    def _read(self, shard: StreamShard, stop: threading.Event) -> Records:
        """The records of ``shard``'s offset range, in order (none more once ``stop`` is set).
        Raises StreamSourceError when the broker does not deliver them within
        ``read_timeout_s`` (see RangeReader)."""
        return self._reader().read(
            shard, stop.is_set, self.read_timeout_s, self.poll_s, self.client.keep_alive
        )

    def _decode_all(self, partition: int, records: Records) -> list[T]:
        """The samples of a range's ``records``, decoded in the reader thread (ahead of the
        loop), once each."""
        return self.source.samples(partition, records, self.decode)

    def _reader(self) -> RecordReader:
        if self._consumer is None:
            self._consumer = self.source.open(self.spec, self.decode is not None)
        return self._consumer

    # --- checkpoint -------------------------------------------------------------------------
    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """Where to resume: the stream's position when every rank had taken ``consumed`` records
        in this pass (default: as many as this rank has taken; right after a step, with
        num_workers=0, that is every record the step trained). No collective runs."""
        count = self._count() if consumed is None else consumed
        position = self.client.position_at(count)
        return {"topic": self.topic, "position": position.to_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume at a ``state_dict()``; every rank may call it (the master applies one
        checkpoint's position once per restart)."""
        if state.get("topic") != self.topic:
            raise InvalidPositionError(
                f"this stream state is of {state.get('topic')!r}, the dataset reads {self.topic!r}"
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


_Item = tuple[StreamShard, list[Any], list[int]]
"""A range, its samples (decoded) and their offsets."""


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
        self._current: tuple[StreamShard, list[int], Iterator[Any]] | None = None
        """The range the loop is in: its offsets and the iterator the loop takes samples from."""
        self._yielded_before = 0
        """Records of the ranges the loop finished in this pass."""
        self._unread: list[StreamShard] = []
        """Ranges the thread leased but did not queue (the pass was closed meanwhile)."""
        self._ended = False
        self._closed_after = 0
        self._to_report: list[StreamShard] = []
        self._report_queued = False
        self._reports_lock = threading.Lock()
        self._pending: tuple[list[_Item], Future[int]] | None = None
        """Ranges read and decoded whose marks are on their way to the master (one call): the
        loop gets them once the master accepted the marks, which it answers while the next
        ranges are read."""
        self._marking: list[_Item] = []
        """Ranges read whose marks are not sent yet: they go MARK_EVERY in one call."""
        self._lease = ThreadPoolExecutor(1, thread_name_prefix=f"stream-lease-{dataset.topic}")
        self._leasing: Future[StreamFetchResult] | None = None
        """The lease asked ahead while ranges are read (its ranges go to the client in the
        reader's thread, the one that polls it)."""
        self._calls = ThreadPoolExecutor(1, thread_name_prefix=f"stream-master-{dataset.topic}")
        """The thread of this pass's calls to the master that the reader need not wait for
        (reports, marks answered while the next range is read), in the order they were made."""
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
        return item

    def current(self, item: _Item) -> Iterator[Any]:
        """The samples of ``item`` for the loop to yield: the range it is in from now on."""
        shard, samples, offsets = item
        records = iter(samples)
        self._current = (shard, offsets, records)
        return records

    def yielded(self) -> int:
        """Records the loop has yielded in this pass (read from its iterator's progress, so the
        loop does no bookkeeping per record)."""
        current = self._current
        if current is None:
            return self._yielded_before
        _, offsets, records = current
        return self._yielded_before + len(offsets) - operator.length_hint(records)

    @property
    def taken(self) -> tuple[StreamShard, int, int] | None:
        """The range the loop is in: (range, first offset not yielded, records yielded)."""
        current = self._current
        if current is None:
            return None
        shard, offsets, records = current
        count = len(offsets) - operator.length_hint(records)
        return (shard, offsets[count - 1] + 1 if count else shard.start, count)

    def finished(self, shard: StreamShard) -> None:
        """The loop has yielded every record of ``shard``."""
        current = self._current
        if current is not None:
            self._yielded_before += len(current[1])
        self._current = None
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
        try:
            self._give_back()
        finally:
            self._calls.shutdown(wait=True)  # the reports queued reach the master first

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
            # After the reports and marks queued before: the master sees them in order.
            self._call(self.client.give_back, remainders)
            # The pass ended here: a position at this count must not wait for more.
            self._call(self.client.send_mark, StreamMark(self._closed_after))
        except Exception as error:  # the ranges stay leased until their lease runs out
            logger.warning("could not give back the unread ranges %s: %s", remainders, error)

    def _take_leases(self, *, wait: bool) -> None:
        """Hand the ranges of the lease asked ahead to the client, once it is answered (waiting
        for it with ``wait``); raises what it met."""
        if self._leasing is not None and (wait or self._leasing.done()):
            leasing, self._leasing = self._leasing, None
            self.client.take_leases(leasing.result())

    def _read_ahead(self) -> None:
        try:
            self._read_ranges()
        finally:
            try:  # what it leased is given back with the rest
                self._take_leases(wait=True)
            except Exception as error:
                logger.warning("could not lease ranges ahead: %s", error)
            finally:
                self._lease.shutdown(wait=True)
            # Read and not handed to the loop when the pass was closed: given back.
            if self._pending is not None:
                self._unread += [item[0] for item in self._pending[0]]
                self._pending = None
            self._unread += [item[0] for item in self._marking]
            self._marking = []

    def _read_ranges(self) -> None:
        dataset, client = self.dataset, self.client
        dataset._reader()  # the client connects to the brokers while the master is asked
        begin = 0
        idle_since = logged = time.monotonic()
        while not self._stop.is_set():
            self._report_finished(now=False)
            if self._items.full() and (self._pending is not None or self._marking):
                # The loop is behind: hand it what was read before reading further, so a
                # rank holds no more ranges (memory; records another rank could train) than
                # with a mark per range.
                begin, queued = self._settle_all(begin)
                if not queued:
                    return
            held = self._pending is not None or bool(self._marking)
            self._take_leases(wait=not client.leased_ahead())
            shard = client.poll(0.0 if held else dataset.poll_s)
            if shard is None:
                self._flush_reports()
                if held:  # nothing to read meanwhile: let the loop have what was read
                    begin, queued = self._settle_all(begin)
                    if not queued:
                        return
                    idle_since = time.monotonic()
                    continue
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
            self._unread.append(shard)  # until it is read: given back if the pass closes
            # The partitions of the ranges leased next start fetching while this one is read
            # (this one too, at its start, if it is the first range of its partition).
            dataset._reader().prepare([shard, *client.leased_shards()])
            if self._leasing is None and client.leased_ahead() <= 1 and not client.finished:
                # The next lease's round trip overlaps this reading (and the next one's).
                self._leasing = self._lease.submit(client.fetch_ahead)
            if held and self._items.empty():
                # The loop has nothing queued: it gets the ranges whose marks were answered,
                # and the marks of those read are sent. The pass's first range waits for its
                # answer (~1 ms), not until this one is read too (~100 ms for a partition's
                # first fetch); later, the reader does not wait on the master.
                begin, queued = self._advance(begin, hurry=True, force=not begin)
                if not queued:
                    return
                idle_since = time.monotonic()
            records = dataset._read(shard, self._stop)
            if self._stop.is_set():
                return
            samples = dataset._decode_all(shard.partition, records)
            self._unread.remove(shard)
            self._marking.append((shard, samples, records.offsets))
            client.keep_alive()
            begin, queued = self._advance(begin, hurry=self._items.empty())
            if not queued:
                return
            idle_since = time.monotonic()
        begin, queued = self._settle_all(begin)
        if not queued:
            return
        self._call(client.send_mark, StreamMark(begin))  # this pass has ended after `begin`
        self._ended = True
        self._put(_End())

    def _advance(self, begin: int, *, hurry: bool = False, force: bool = False) -> tuple[int, bool]:
        """Queue the ranges of the marks in flight if the master answered (waiting for the
        answer once MARK_EVERY more ranges are read, or with ``force``), then send the marks of
        the ranges read since, MARK_EVERY in one call (fewer with ``hurry``: the loop has
        nothing queued, or ``force``). Returns the next range's begin, and False if the pass
        was closed meanwhile."""
        if self._pending is not None and (
            force or len(self._marking) >= MARK_EVERY or self._pending[1].done()
        ):
            begin, queued = self._settle(begin)
            if not queued:
                return begin, False
        if (
            self._pending is None
            and self._marking
            and (force or hurry or len(self._marking) >= MARK_EVERY)
        ):
            items, self._marking = self._marking[:MARK_EVERY], self._marking[MARK_EVERY:]
            marks = []
            at = begin  # the begins count the ranges accepted before: the last batch settled
            for shard, samples, _ in items:
                marks.append(
                    StreamMark(at, shard.partition, shard.start, len(samples), shard.attempt)
                )
                at += len(samples)
            self._pending = (items, self._calls.submit(self.client.send_marks, marks))
        return begin, True

    def _settle_all(self, begin: int) -> tuple[int, bool]:
        """Mark and queue every range read: the loop gets them all."""
        while self._pending is not None or self._marking:
            begin, queued = self._advance(begin, force=True)
            if not queued:
                return begin, False
        return begin, True

    def _settle(self, begin: int) -> tuple[int, bool]:
        """Wait for the master's answer to the marks in flight and queue the ranges it accepted;
        returns the next range's begin, and False if the pass was closed meanwhile (the ranges
        not queued are then given back with the unread ones)."""
        assert self._pending is not None
        items, answer = self._pending
        accepted = answer.result()  # raising, the ranges stay pending: given back
        for index, item in enumerate(items[:accepted]):
            if not self._put(item):
                self._pending = (items[index:], answer)
                return begin, False
            begin += len(item[1])
        self._pending = None
        if accepted < len(items):
            # Another worker may hold it now: yielding it would train it twice. The marks after
            # it counted its records: they are sent again.
            logger.warning("lost the lease on %s while reading it: skipped", items[accepted][0])
            self._marking[:0] = items[accepted + 1 :]
        return begin, True

    def _call(self, fn: Callable[..., R], *args: Any) -> R:
        """``fn(*args)`` on the thread of master calls, after the ones queued before it."""
        return self._calls.submit(fn, *args).result()

    def _put(self, item: _Item | _End | BaseException) -> bool:
        """Queue ``item`` once there is room (the loop takes items as it trains); False if the
        pass was closed meanwhile. Reports finished ranges as the loop finishes them, and keeps
        the leases alive, while it waits."""
        while not self._stop.is_set():
            self._wake.clear()
            self._report_finished(now=False)
            try:
                self._items.put_nowait(item)
                return True
            except queue.Full:
                pass
            self._flush_reports()  # the reader waits for the loop: nothing else to send
            self._wake.wait(1.0)  # set when the loop takes an item or finishes a range
            self.client.keep_alive()
        return False

    def _report_finished(self, *, now: bool = True) -> None:
        while True:
            try:
                shard = self._done.get_nowait()
            except queue.Empty:
                break
            if shard is None:
                self._done.put(None)  # keep the close marker for _run
                break
            self._report(shard, now=now)
        if now:
            self._flush_reports()

    def _report(self, shard: StreamShard, *, now: bool = True) -> None:
        """Report ``shard`` done on the thread of master calls; the reader goes on meanwhile.
        Ranges finished while that thread is busy go in one call. With ``now`` False the report
        waits until REPORT_EVERY ranges are finished: nothing waits on a report, while the
        reader waits on each range's mark, which queued behind a report per range."""
        with self._reports_lock:
            self._to_report.append(shard)
            due = now or len(self._to_report) >= REPORT_EVERY
        if due:
            self._flush_reports()

    def _flush_reports(self) -> None:
        """Report the finished ranges held back by ``_report(now=False)``."""
        with self._reports_lock:
            if self._report_queued or not self._to_report:
                return
            self._report_queued = True
        self._calls.submit(self._report_now)

    def _report_now(self) -> None:
        with self._reports_lock:
            shards, self._to_report = self._to_report, []
            self._report_queued = False
        try:
            self.client.report_all_done(shards)
        except Exception as error:  # the ranges stay leased; their lease or a restore settles it
            logger.warning("could not report %s done: %s", shards, error)


def _transport_from_env() -> StreamTransport:
    address = os.environ.get(ENV_MASTER_ADDR, "")
    if not address:
        raise InvalidSpecError(
            f"ElasticStreamDataset needs the job master, which shares the topic among the ranks: "
            f"run the script with dlrover-run (it sets {ENV_MASTER_ADDR}), or pass transport="
        )
    from dlrover.client.sharding import connect

    return connect(address)
