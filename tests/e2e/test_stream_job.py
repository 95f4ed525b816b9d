"""Online learning from a real Kafka-protocol broker under dlrover-run: exactly once, through a
worker SIGKILL and a flash-checkpoint restore, with records produced while the job trains."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import SCRIPTS, clean_env, dlrover_run
from tests.kafka_broker import KafkaBroker, kafka_missing

pytestmark = [
    pytest.mark.extras,
    pytest.mark.skipif(bool(kafka_missing()), reason=kafka_missing() or "ok"),
]

PARTITIONS = 3


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[KafkaBroker]:
    (tmp_path / "broker").mkdir()
    b = KafkaBroker(tmp_path / "broker")
    try:
        yield b
    finally:
        b.stop()


def _records(ids: range) -> list[tuple[int, bytes]]:
    """Record ``i`` goes to partition ``i % 3``, so partition p's offset o holds id 3 * o + p."""
    return [(i % PARTITIONS, json.dumps({"id": i}).encode()) for i in ids]


def _when_step_reached(progress: Path, step: int, timeout_s: float) -> bool:
    """Whether rank 0 reported ``step`` within the timeout (another process's file: polled)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = progress.read_text().strip() if progress.exists() else ""
        if text and int(text) >= step:
            return True
        time.sleep(0.05)
    return False


def _train_args(
    broker: KafkaBroker, n: int, per_partition: int, ckpt: Path, out: Path
) -> list[str]:
    """stream_train.py's arguments: topic clicks, batches of 3, ranges of 5 records."""
    return [
        "--bootstrap", broker.bootstrap, "--topic", "clicks", "--records", str(n),
        "--end", str(per_partition), "--batch", "3", "--records-per-shard", "5",
        "--ckpt", str(ckpt), "--out", str(out),
    ]  # fmt: skip


def assert_mode_kept(mode: str, out: Path) -> None:
    """stream_train.py's tally of each record id in the final model (<out>/seen.json) and the
    master's lost count (<out>/lost) as ``mode`` promises: at least once none lost; at most
    once none twice, and the loss counted is exactly the ids the model never trained."""
    seen = json.loads((out / "seen.json").read_text())
    lost = int((out / "lost").read_text())
    if mode == "at-least-once":
        assert min(seen) >= 1 and lost == 0, {i: c for i, c in enumerate(seen) if c != 1}
        return
    assert max(seen) == 1, {i: c for i, c in enumerate(seen) if c > 1}
    assert lost == seen.count(0) > 0


def _committed(broker: KafkaBroker, group: str, topic: str) -> list[int]:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": group})
    try:
        parts = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        return [tp.offset for tp in consumer.committed(parts, timeout=10)]
    finally:
        consumer.close()


@pytest.mark.parametrize("rank0_position", [False, True], ids=["every-rank", "rank0-only"])
def test_worker_killed_mid_stream_every_record_is_trained_exactly_once(
    tmp_path: Path, broker: KafkaBroker, rank0_position: bool
) -> None:
    n, per_partition = 120, 40
    broker.create_topic("clicks", PARTITIONS)
    broker.produce("clicks", _records(range(n // 2)))  # the rest arrives while the job trains
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    once = tmp_path / "fault.once"
    env = clean_env(DLROVER_FAULTS=f"kill:rank=1:step=7:once={once}")
    late_produced = threading.Event()

    def produce_late() -> None:
        if _when_step_reached(out / "progress", 3, 90):
            broker.produce("clicks", _records(range(n // 2, n)))
            late_produced.set()

    producer = threading.Thread(target=produce_late, daemon=True)
    producer.start()
    args = [
        "--standalone", "--nproc-per-node=2", "--max-restarts=1",
        str(SCRIPTS / "stream_train.py"), "--bootstrap", broker.bootstrap, "--topic", "clicks",
        "--records", str(n), "--end", str(per_partition), "--batch", "3",
        "--records-per-shard", "5", "--ckpt", str(ckpt), "--out", str(out),
    ]  # fmt: skip
    if rank0_position:
        args.append("--rank0-position")
    r = dlrover_run(args, env=env, timeout=180)
    producer.join(5)
    assert r.returncode == 0, r.stderr[-4000:]
    assert late_produced.is_set(), "the job ended before the late records were produced"
    assert "dlrover fault injection: kill rank 1 step 7" in r.stderr
    seen = json.loads((out / "seen.json").read_text())
    assert seen == [1] * n, {i: c for i, c in enumerate(seen) if c != 1}
    # The restarted workers resumed from the checkpoint of step 6 (mid-shard: 18 records of 5-record shards), not from the start.
    loads = [line.split() for line in (out / "loads").read_text().splitlines()]
    assert sorted(loads) == [["0", "0", "1"], ["0", "1", "7"], ["1", "0", "1"], ["1", "1", "7"]]
    # The master committed the finished offsets under the stream's group at the end.
    assert _committed(broker, "dlrover-clicks", "clicks") == [per_partition] * PARTITIONS


@pytest.mark.parametrize("mode", ["at-most-once", "at-least-once"])
def test_each_delivery_mode_keeps_its_promise_through_a_worker_kill(
    tmp_path: Path, broker: KafkaBroker, mode: str
) -> None:
    """DLROVER_DELIVERY_MODE (what a job spec's delivery_mode sets), rank 1 SIGKILLed at step
    7, the ranks restart from the checkpoint of step 6. At most once the stream does not go
    back to its position: no record is trained twice, and the records the final model never
    trained are exactly the master's lost count (what was handed out after the checkpoint).
    At least once none is lost (and, the position restored, none is trained twice either)."""
    n, per_partition = 120, 40
    broker.create_topic("clicks", PARTITIONS)
    broker.produce("clicks", _records(range(n)))
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    once = tmp_path / "fault.once"
    env = clean_env(DLROVER_FAULTS=f"kill:rank=1:step=7:once={once}", DLROVER_DELIVERY_MODE=mode)
    r = dlrover_run(
        [
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            str(SCRIPTS / "stream_train.py"),
            *_train_args(broker, n, per_partition, ckpt, out),
        ],  # fmt: skip
        env=env,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "dlrover fault injection: kill rank 1 step 7" in r.stderr
    assert_mode_kept(mode, out)
    if mode == "at-most-once":
        assert "is at-most-once: not going back to the checkpoint's position" in r.stderr


def test_a_broker_outage_mid_job_loses_no_position(tmp_path: Path, broker: KafkaBroker) -> None:
    """The broker stops for two seconds while the job trains: the master keeps its offsets, the
    readers wait (within read_timeout_s) and the job trains every record exactly once."""
    n, per_partition = 120, 40
    broker.create_topic("clicks", PARTITIONS)
    broker.produce("clicks", _records(range(n)))
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    outage_over = threading.Event()

    def outage() -> None:
        if _when_step_reached(out / "progress", 3, 90):
            broker.stop(graceful=True)
            time.sleep(2.0)  # the outage itself
            broker.start()
            outage_over.set()

    thread = threading.Thread(target=outage, daemon=True)
    thread.start()
    r = dlrover_run(
        [
            "--standalone",
            "--nproc-per-node=2",
            str(SCRIPTS / "stream_train.py"),
            *_train_args(broker, n, per_partition, ckpt, out),
        ],  # fmt: skip
        timeout=180,
    )
    thread.join(10)
    assert r.returncode == 0, r.stderr[-4000:]
    assert outage_over.is_set()
    assert "do not answer" in r.stderr  # the master noticed, once
    seen = json.loads((out / "seen.json").read_text())
    assert seen == [1] * n, {i: c for i, c in enumerate(seen) if c != 1}
    assert _committed(broker, "dlrover-clicks", "clicks") == [per_partition] * PARTITIONS
