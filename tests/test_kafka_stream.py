"""ElasticStreamDataset and StreamShardingClient against a real master (gRPC on port 0) and a
real Kafka-protocol broker: exact resume, records that arrive while reading, explicit stop,
broker outages and clear errors."""

from __future__ import annotations

import json
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dlrover.client.sharding import GrpcShardingTransport, connect
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.server import MasterServer
from dlrover.master.state_store import MemoryStateStore, SqliteStateStore, StateStore
from dlrover.sharding.errors import InvalidSpecError, StreamSourceError
from tests.kafka_broker import KafkaBroker, kafka_missing

pytestmark = [
    pytest.mark.extras,
    pytest.mark.skipif(bool(kafka_missing()), reason=kafka_missing() or "ok"),
]

TOKEN = "t"


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[KafkaBroker]:
    (tmp_path / "broker").mkdir()
    b = KafkaBroker(tmp_path / "broker")
    try:
        yield b
    finally:
        b.stop()


class Master:
    """A job master serving on a free port of loopback."""

    def __init__(self, store: StateStore | None = None) -> None:
        self.server = MasterServer(
            JobMaster(JobMasterConfig(), store or MemoryStateStore()), TOKEN, "127.0.0.1", 0
        )
        self.server.start()
        self.addr = f"127.0.0.1:{self.server.port}"

    def transport(self) -> GrpcShardingTransport:
        return connect(self.addr, TOKEN)

    def stop(self) -> None:
        self.server.stop(0.1)


@pytest.fixture
def master() -> Iterator[Master]:
    m = Master()
    try:
        yield m
    finally:
        m.stop()


def _produce(broker: KafkaBroker, topic: str, ids: range, partitions: int = 3) -> None:
    broker.produce(topic, [(i % partitions, json.dumps({"id": i}).encode()) for i in ids])


def _record_id(record: Any) -> int:
    return int(json.loads(record.value)["id"])


def _dataset(broker: KafkaBroker, master: Master, worker: str, **kw: Any) -> Any:
    from dlrover.trainer.torch.elastic.stream import ElasticStreamDataset

    kw.setdefault("records_per_shard", 4)
    kw.setdefault("decode", _record_id)
    return ElasticStreamDataset(
        "clicks",
        broker.bootstrap,
        transport=master.transport(),
        worker_id=worker,
        **kw,
    )


def _thirty_records(broker: KafkaBroker, master: Master) -> Any:
    """A reader of a topic of ids 0..29 in 3 partitions, ending there."""
    broker.create_topic("clicks", 3)
    _produce(broker, "clicks", range(30))
    return _dataset(broker, master, "w0", end_offsets={0: 10, 1: 10, 2: 10})


def _resumed(broker: KafkaBroker, master: Master, state: Any, **kw: Any) -> list[int]:
    """Every id a new reader restored at ``state`` yields (to the end offsets in ``kw``)."""
    again = _dataset(broker, master, "w0", **kw)
    again.load_state_dict(state)
    rest = list(again)
    again.close()
    return rest


def test_resume_at_a_saved_position_trains_no_record_twice_and_skips_none(
    broker: KafkaBroker, master: Master
) -> None:
    broker.create_topic("clicks", 3)
    _produce(broker, "clicks", range(60))
    ends = {0: 20, 1: 20, 2: 20}
    reader = _dataset(broker, master, "w0", end_offsets=ends)
    records = iter(reader)
    before = [next(records) for _ in range(11)]  # mid-shard: shards are 4 records
    state = json.loads(json.dumps(reader.state_dict()))  # what a checkpoint keeps
    after_save = [next(records) for _ in range(9)]  # trained, then lost with the process
    assert len(set(before + after_save)) == 20
    reader.close()

    rest = _resumed(broker, master, state, end_offsets=ends)
    assert sorted(before + rest) == list(range(60))


def test_batches_cut_across_ranges_and_resume_exactly_where_the_last_batch_ended(
    broker: KafkaBroker, master: Master
) -> None:
    """``batches(n)`` hands out lists cut from the queued ranges (of 4 records: batches of 5
    span two), and a position taken after a batch counts exactly the records handed out."""
    broker.create_topic("clicks", 3)
    _produce(broker, "clicks", range(60))
    ends = {0: 20, 1: 20, 2: 20}
    reader = _dataset(broker, master, "w0", end_offsets=ends)
    batches = reader.batches(5)
    before = [next(batches) for _ in range(3)]
    assert [len(b) for b in before] == [5, 5, 5]
    state = json.loads(json.dumps(reader.state_dict()))
    lost = next(batches)  # trained after the checkpoint, then lost with the process
    taken = [i for b in before for i in b]
    assert len(set(taken + lost)) == 20
    reader.close()

    again = _dataset(broker, master, "w0", end_offsets=ends)
    again.load_state_dict(state)
    rest = list(again.batches(7))
    again.close()
    assert [len(b) for b in rest] == [7] * 6 + [3]  # 45 records left: the last batch is short
    assert sorted(taken + [i for b in rest for i in b]) == list(range(60))


def test_a_batch_being_filled_when_the_broker_fails_is_handed_out_before_the_error(
    broker: KafkaBroker, master: Master
) -> None:
    """The broker stops once the reader has decoded two ranges; batches of 1000 (more than
    the stream holds) are still being filled when the reader's error comes. What they hold is
    handed out first, so a position taken after the error counts exactly what the loop got
    (dropped, those records were lost: counted as trained, never trained)."""
    broker.create_topic("clicks", 10)
    _produce(broker, "clicks", range(30), partitions=10)
    ends = {p: 3 for p in range(10)}
    decoded: list[int] = []

    def decode(record: Any) -> int:
        decoded.append(_record_id(record))
        if len(decoded) == 6:  # in the reader's thread: it reads on only after the stop
            broker.stop(graceful=True)
        return decoded[-1]

    reader = _dataset(broker, master, "w0", end_offsets=ends, read_timeout_s=3.0, decode=decode)
    got: list[int] = []
    with pytest.raises(StreamSourceError, match=r"did not deliver records"):
        for batch in reader.batches(1000):
            got += batch
    assert len(got) >= 6
    state = reader.state_dict()
    reader.close()
    broker.start()
    assert sorted(got + _resumed(broker, master, state, end_offsets=ends)) == list(range(30))


def test_a_batches_loop_left_midway_gives_back_the_rest_and_the_next_pass_reads_it(
    broker: KafkaBroker, master: Master
) -> None:
    reader = _thirty_records(broker, master)
    first: list[int] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an exception in the generator's close is a warning
        batches = reader.batches(3)
        for batch in batches:
            first += batch
            if len(first) == 9:
                break
        batches.close()
    rest = [i for batch in reader.batches(5) for i in batch]
    reader.close()
    assert len(first) == 9
    assert sorted(first + rest) == list(range(30))


def test_batches_of_a_whole_pass_and_a_wrong_batch_size(
    broker: KafkaBroker, master: Master
) -> None:
    reader = _thirty_records(broker, master)
    with pytest.raises(InvalidSpecError, match="batch_size must be >= 1"):
        next(reader.batches(0))
    batches = list(reader.batches(8))
    assert [len(b) for b in batches] == [8, 8, 8, 6]
    assert sorted(i for b in batches for i in b) == list(range(30))
    reader.close()


def test_records_produced_while_reading_arrive_and_stop_ends_the_stream(
    broker: KafkaBroker, master: Master
) -> None:
    broker.create_topic("clicks", 3)
    _produce(broker, "clicks", range(12))
    reader = _dataset(broker, master, "w0", poll_s=0.2)
    seen: list[int] = []
    for record in reader:
        seen.append(record)
        if len(seen) == 12:
            _produce(broker, "clicks", range(12, 30))  # the stream grows while it is read
        if len(seen) == 30:
            reader.stop()  # explicit end: the pass ends once the ranges held are read
    reader.close()
    assert sorted(seen) == list(range(30))
    progress = master.transport().stream_progress("clicks")
    assert progress.stopped and progress.finished and progress.lag == 0


def test_two_readers_share_the_stream_and_offsets_are_committed_under_the_group(
    broker: KafkaBroker, master: Master
) -> None:
    from confluent_kafka import Consumer, TopicPartition

    broker.create_topic("clicks", 3)
    _produce(broker, "clicks", range(90))
    got: dict[str, list[int]] = {}

    def read(worker: str) -> None:
        reader = _dataset(broker, master, worker, end_offsets={0: 30, 1: 30, 2: 30})
        got[worker] = list(reader)
        reader.close()

    threads = [threading.Thread(target=read, args=(w,)) for w in ("w0", "w1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(got["w0"] + got["w1"]) == list(range(90))  # each record by one reader
    master.stop()  # a last commit before the master goes
    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "dlrover-clicks"})
    committed = consumer.committed([TopicPartition("clicks", p) for p in range(3)], timeout=10)
    consumer.close()
    assert [tp.offset for tp in committed] == [30, 30, 30]


def test_a_new_stream_starts_where_its_group_committed(broker: KafkaBroker, master: Master) -> None:
    from confluent_kafka import Consumer, TopicPartition

    broker.create_topic("clicks", 3)
    _produce(broker, "clicks", range(30))
    group = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "mine"})
    group.commit(offsets=[TopicPartition("clicks", p, 4) for p in range(3)], asynchronous=False)
    group.close()
    reader = _dataset(broker, master, "w0", group_id="mine", end_offsets={0: 10, 1: 10, 2: 10})
    assert sorted(reader) == list(range(12, 30))  # offsets 4.. of each partition
    reader.close()


def test_broker_down_reader_fails_clearly_in_bounded_time_and_the_position_survives(
    broker: KafkaBroker, master: Master
) -> None:
    # Ten partitions of one range each: what the reader fetched before the outage it still
    # serves from memory (it reads a few ranges ahead), the partitions it had not reached need
    # the broker.
    broker.create_topic("clicks", 10)
    _produce(broker, "clicks", range(30), partitions=10)
    ends = {p: 3 for p in range(10)}
    reader = _dataset(broker, master, "w0", end_offsets=ends, read_timeout_s=3.0)
    records = iter(reader)
    trained = [next(records) for _ in range(6)]
    state = reader.state_dict()
    broker.stop(graceful=True)
    with pytest.raises(StreamSourceError, match=r"did not deliver records .* within 3s"):
        for _ in range(30):
            next(records)
    reader.close()
    # The master kept its place while the broker was away; with the broker back, a restarted
    # reader resumes at the checkpoint and reads exactly the rest.
    broker.start()
    assert sorted(trained + _resumed(broker, master, state, end_offsets=ends)) == list(range(30))


def test_an_outage_costs_a_line_a_second_per_client_not_twenty(
    broker: KafkaBroker, master: Master, capfd: pytest.CaptureFixture[str]
) -> None:
    """librdkafka logs every dial of a broker that refuses; the master's client and the
    reader's dial again after DEFAULT_RECONNECT_BACKOFF_MS, not every ~50 ms (the campaign's
    stream jobs logged ~290 such lines through a 15 s outage)."""
    broker.create_topic("clicks", 10)
    _produce(broker, "clicks", range(30), partitions=10)
    ends = {p: 3 for p in range(10)}
    reader = _dataset(broker, master, "w0", end_offsets=ends, read_timeout_s=4.0)
    records = iter(reader)
    [next(records) for _ in range(6)]
    capfd.readouterr()
    broker.stop(graceful=True)
    began = time.monotonic()
    with pytest.raises(StreamSourceError, match=r"did not deliver records"):
        for _ in range(30):
            next(records)
    elapsed = time.monotonic() - began
    reader.close()
    dials = capfd.readouterr().err.count("Connect to")
    # Two clients (master, reader) at about one dial a second each; 20 a second each before.
    assert dials <= 4 * (elapsed + 1), (dials, elapsed)


def test_a_restarted_master_resumes_its_streams_even_while_the_broker_is_down(
    broker: KafkaBroker, tmp_path: Path
) -> None:
    broker.create_topic("clicks", 3)
    _produce(broker, "clicks", range(30))
    ends = {0: 10, 1: 10, 2: 10}
    first = Master(SqliteStateStore(tmp_path / "state.db"))
    reader = _dataset(broker, first, "n0/0", end_offsets=ends)
    records = iter(reader)
    read = [next(records) for _ in range(9)]  # two whole shards and one record of a third
    reader.close()  # gives the rest of the third and the ranges read ahead back
    first.stop()
    broker.stop(graceful=True)
    second = Master(SqliteStateStore(tmp_path / "state.db"))  # needs no broker to start
    try:
        progress = second.transport().stream_progress("clicks")
        assert sum(offset for _, offset in progress.committed) == 9
        assert progress.leased == 0
        broker.start()
        # The reader's node rejoins (as its agent would): it held nothing any more.
        assert second.server.job.sharding.recover_node("n0") == 0
        rest = list(_dataset(broker, second, "n0/0", end_offsets=ends))
        assert sorted(read + rest) == list(range(30))
    finally:
        second.stop()


def test_clear_errors_for_a_missing_topic_and_a_missing_master(
    broker: KafkaBroker, master: Master, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dlrover.trainer.torch.elastic.stream import ElasticStreamDataset

    with pytest.raises(StreamSourceError, match="topic 'clicks'.*create it first"):
        next(iter(_dataset(broker, master, "w0")))
    monkeypatch.delenv("DLROVER_MASTER_ADDR", raising=False)
    with pytest.raises(InvalidSpecError, match="needs the job master.*dlrover-run"):
        ElasticStreamDataset("clicks", broker.bootstrap)


def test_the_lag_of_each_partition_is_a_metric(broker: KafkaBroker, master: Master) -> None:
    from dlrover.master.metrics import JobMetrics
    from dlrover.sharding.stream import StreamSpec

    broker.create_topic("clicks", 3)
    _produce(broker, "clicks", range(30))
    spec = StreamSpec("clicks", 4, topic="clicks", bootstrap_servers=broker.bootstrap)
    assert master.transport().register_stream(spec).created
    reader = _dataset(broker, master, "w0")
    records = iter(reader)
    for _ in range(8):  # two ranges of partition 0 and 1 read; reported when the loop goes on
        next(records)
    next(records)
    # The reader thread reports finished ranges as the loop leaves them: the lag follows.
    expected = {"0": 6.0, "1": 6.0, "2": 10.0}
    deadline = time.monotonic() + 10
    while (lags := _lags(JobMetrics(master.server.job).render().decode())) != expected:
        assert time.monotonic() < deadline, lags
        time.sleep(0.01)
    reader.close()


def _lags(page: str) -> dict[str, float]:
    return {
        line.split('partition="')[1][0]: float(line.split()[-1])
        for line in page.splitlines()
        if line.startswith("dlrover_stream_lag_records{")
    }


def test_registering_asks_the_broker_outside_the_lock_and_closes_a_source_that_failed(
    broker: KafkaBroker,
) -> None:
    from dlrover.master.sharding_service import ShardingService
    from dlrover.sharding.errors import UnknownDatasetError
    from dlrover.sharding.kafka_source import KafkaStreamSource
    from dlrover.sharding.stream import StreamSpec

    broker.create_topic("clicks", 3)

    def source_for(spec: StreamSpec, partitions: Any) -> KafkaStreamSource:
        # The real source with its partitions given, so the broker is first asked for the
        # start offsets; 2 s per request while the broker is gone.
        return KafkaStreamSource(
            spec.topic, spec.bootstrap_servers, timeout_s=2.0, partitions=[0, 1, 2]
        )

    store = MemoryStateStore()
    job = JobMaster(JobMasterConfig(), store)
    job.sharding = ShardingService(store, time.monotonic, source_factory=source_for)
    server = MasterServer(job, TOKEN, "127.0.0.1", 0)
    server.start()
    transport = connect(f"127.0.0.1:{server.port}", TOKEN)
    try:
        broker.stop()
        errors: list[BaseException] = []

        def register() -> None:
            try:
                spec = StreamSpec("clicks", 4, topic="clicks", bootstrap_servers=broker.bootstrap)
                transport.register_stream(spec)
            except BaseException as error:
                errors.append(error)

        registering = threading.Thread(target=register)
        registering.start()
        time.sleep(0.5)  # the registration waits for the broker now
        assert registering.is_alive()
        began = time.monotonic()
        with pytest.raises(UnknownDatasetError):
            transport.stream_progress("other")  # a sharding call: it must not wait for that
        assert time.monotonic() - began < 1.0
        registering.join(30)
        assert [type(e) for e in errors] == [StreamSourceError]
        # The source made for the refused registration was closed: no reader thread is left.
        assert not [t for t in threading.enumerate() if t.name == "kafka-offsets-clicks"]
    finally:
        server.stop(0.1)


def test_offsets_without_records_transaction_markers_end_a_range_and_count_exactly_once(
    broker: KafkaBroker, master: Master
) -> None:
    from confluent_kafka import Producer

    broker.create_topic("clicks", 1)
    producer = Producer({"bootstrap.servers": broker.bootstrap, "transactional.id": "t"})
    producer.init_transactions(10)
    for first in (0, 3, 6):  # 3 records and a commit marker each: offsets 0-2 (3), 4-6 (7), ...
        producer.begin_transaction()
        for i in range(first, first + 3):
            producer.produce("clicks", json.dumps({"id": i}).encode(), partition=0)
        producer.commit_transaction(10)
    # Ranges of 4 offsets end on a marker: without the position rule each waited for it.
    reader = _dataset(broker, master, "w0", end_offsets={0: 12}, read_timeout_s=3.0)
    records = iter(reader)
    before = [next(records) for _ in range(4)]  # a whole range and one record of the next
    state = json.loads(json.dumps(reader.state_dict()))
    assert state["position"]["offsets"] == [[0, 5]]  # offset 4 was trained, 5 was not
    reader.close()
    rest = _resumed(broker, master, state, end_offsets={0: 12}, read_timeout_s=3.0)
    assert sorted(before + rest) == list(range(9))


@pytest.mark.parametrize("kept_from", [6, 12])
def test_a_checkpoint_older_than_retention_reads_what_is_left(
    broker: KafkaBroker, master: Master, kept_from: int
) -> None:
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    broker.create_topic("clicks", 1)
    broker.produce("clicks", [(0, json.dumps({"id": i}).encode()) for i in range(12)])
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for future in admin.delete_records([TopicPartition("clicks", 0, kept_from)]).values():
        future.result(10)  # what retention does: offsets below kept_from are gone
    reader = _dataset(broker, master, "w0", end_offsets={0: 12}, read_timeout_s=3.0)
    reader.load_state_dict(
        {"topic": "clicks", "position": {"stream": "clicks", "offsets": [[0, 0]], "pending": []}}
    )
    assert sorted(reader) == list(range(kept_from, 12))
    reader.close()


def test_a_reader_keeps_its_leases_while_the_broker_is_slow(
    broker: KafkaBroker, master: Master, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import signal

    monkeypatch.setenv("DLROVER_SHARD_LEASE_S", "2")
    broker.create_topic("clicks", 3)
    _produce(broker, "clicks", range(24))
    reader = _dataset(broker, master, "w0", end_offsets={0: 8, 1: 8, 2: 8}, poll_s=0.2)
    reader.client.start()  # registered while the broker answers
    assert broker.proc is not None
    os.kill(broker.proc.pid, signal.SIGSTOP)  # a broker that answers nothing for 5 s
    resume = threading.Timer(5.0, os.kill, (broker.proc.pid, signal.SIGCONT))
    resume.start()
    try:
        seen = list(reader)
    finally:
        resume.join()
    reader.close()
    assert sorted(seen) == list(range(24))  # no lease expired under the reader: none read twice


def test_a_reader_keeps_its_leases_while_the_loop_trains_its_last_ranges(
    broker: KafkaBroker, master: Master, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DLROVER_SHARD_LEASE_S", "2")
    broker.create_topic("clicks", 3)
    _produce(broker, "clicks", range(24))
    ends = {0: 8, 1: 8, 2: 8}  # six ranges of 4
    first = _dataset(broker, master, "w0", end_offsets=ends, poll_s=0.2)
    records = iter(first)
    seen = [next(records) for _ in range(17)]  # in the fifth range: the reader has no more to ask
    time.sleep(5.0)  # a slow step: longer than the lease
    second = _dataset(broker, master, "w1", end_offsets=ends, poll_s=0.2)
    seen += list(second)  # nothing left for it: w0 still holds its ranges
    seen += list(records)
    first.close()
    second.close()
    assert sorted(seen) == list(range(24))


def test_a_pass_closed_midway_gives_its_unread_ranges_back_and_counts_exactly_once(
    broker: KafkaBroker, master: Master
) -> None:
    broker.create_topic("clicks", 3)
    _produce(broker, "clicks", range(60))
    ends = {0: 20, 1: 20, 2: 20}
    reader = _dataset(broker, master, "w0", end_offsets=ends)
    records = iter(reader)
    first = [next(records) for _ in range(6)]  # mid-range, with ranges queued behind it
    records.close()  # the pass ends here, as after `for b in islice(loader, n)`
    closed = json.loads(json.dumps(reader.state_dict()))  # where that pass stopped
    second = iter(reader)  # the next pass reads the rest first, and every range once
    trained = [next(second) for _ in range(10)]
    state = json.loads(json.dumps(reader.state_dict()))
    trained += list(second)
    reader.close()
    assert sorted(first + trained) == list(range(60))
    # The position taken in the second pass counts the first pass's records as trained.
    rest = _resumed(broker, master, state, end_offsets=ends)
    assert sorted(first + trained[:10] + rest) == list(range(60))
    rest = _resumed(broker, master, closed, end_offsets=ends)
    assert sorted(first + rest) == list(range(60))


def test_a_position_asked_after_a_worker_was_lost_still_counts_what_it_read_after_the_step(
    broker: KafkaBroker, master: Master
) -> None:
    from dlrover.client.stream_client import StreamShardingClient
    from dlrover.sharding.stream import StreamMark, StreamPosition, StreamSpec

    broker.create_topic("clicks", 1)
    broker.produce("clicks", [(0, json.dumps({"id": i}).encode()) for i in range(16)])
    spec = StreamSpec(
        "clicks", 4, topic="clicks", bootstrap_servers=broker.bootstrap, end_offsets=((0, 16),)
    )
    alive = StreamShardingClient(master.transport(), spec, "n0/0", prefetch=1)
    lost = StreamShardingClient(master.transport(), spec, "n1/0", prefetch=1)
    a = alive.poll(5)
    assert a is not None and alive.mark(StreamMark(0, 0, a.start))
    b = lost.poll(5)
    assert b is not None and lost.mark(StreamMark(0, 0, b.start))
    # Both trained 2 records at the step; the lost worker then read the rest of [4, 8) and
    # one record of [8, 12) before it died.
    lost.report_done(b)
    c = lost.poll(5)
    assert c is not None and lost.mark(StreamMark(4, 0, c.start))
    assert master.server.job.sharding.recover_node("n1") == 1
    # At the step, [2, 4) and [6, 8) were not trained, and [8, 12) is read again whole.
    assert alive.position_at(2, timeout_s=5) == StreamPosition("clicks", ((0, 6),), ((0, 2, 4),))


def test_each_rank_decodes_only_the_records_it_trains_once_each(
    broker: KafkaBroker, master: Master
) -> None:
    """A reader is handed records of every partition it reads; those of ranges another rank
    holds must not reach its decode (an expensive or side-effecting decode, a record another
    rank owns that this one cannot decode)."""
    from dlrover.trainer.torch.elastic.stream import ElasticStreamDataset

    broker.create_topic("clicks", 3)
    _produce(broker, "clicks", range(600))
    ends = {0: 200, 1: 200, 2: 200}
    decoded: dict[str, list[int]] = {"w0": [], "w1": []}
    yielded: dict[str, list[int]] = {"w0": [], "w1": []}

    def read(worker: str) -> None:
        def decode(record: Any) -> int:
            decoded[worker].append(_record_id(record))
            return _record_id(record)

        reader = ElasticStreamDataset(
            "clicks",
            broker.bootstrap,
            decode=decode,
            records_per_shard=10,
            end_offsets=ends,
            transport=master.transport(),
            worker_id=worker,
        )
        yielded[worker] = list(reader)
        reader.close()

    threads = [threading.Thread(target=read, args=(w,)) for w in ("w0", "w1")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(yielded["w0"] + yielded["w1"]) == list(range(600))
    for worker in ("w0", "w1"):
        assert decoded[worker] == yielded[worker], worker


def test_a_pass_that_failed_in_decode_is_iterated_again_without_losing_a_record(
    broker: KafkaBroker, master: Master
) -> None:
    from dlrover.trainer.torch.elastic.stream import ElasticStreamDataset

    broker.create_topic("clicks", 2)
    _produce(broker, "clicks", range(80), partitions=2)
    failed: list[int] = []

    def decode(record: Any) -> int:
        if record.partition == 1 and not failed:  # once: a transient failure
            failed.append(record.offset)
            raise ValueError("cannot decode this record now")
        return _record_id(record)

    reader = ElasticStreamDataset(
        "clicks",
        broker.bootstrap,
        decode=decode,
        records_per_shard=4,
        end_offsets={0: 40, 1: 40},
        transport=master.transport(),
        worker_id="w0",
    )
    seen: list[int] = []
    with pytest.raises(ValueError, match="cannot decode"):
        for record_id in reader:
            seen.append(record_id)
    seen += list(reader)  # the script catches it and iterates again
    reader.close()
    assert failed and sorted(seen) == list(range(80))


def test_a_pass_closed_after_the_stream_ended_leaves_the_next_pass_what_it_gave_back(
    broker: KafkaBroker, master: Master
) -> None:
    """The first pass's reader learns the stream has ended (it leased its last ranges) and
    the loop stops early: the next pass must read the ranges given back, not end at once."""
    broker.create_topic("clicks", 3)
    _produce(broker, "clicks", range(12))
    reader = _dataset(broker, master, "w0", end_offsets={0: 4, 1: 4, 2: 4})
    records = iter(reader)
    first = [next(records)]
    deadline = time.monotonic() + 30
    while not reader.client.finished and time.monotonic() < deadline:
        time.sleep(0.01)  # the reader leases ahead meanwhile, up to the end
    assert reader.client.finished
    records.close()
    rest = list(reader)
    reader.close()
    assert sorted(first + rest) == list(range(12))
