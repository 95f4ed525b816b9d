"""At-most-once delivery on the master: nothing handed out is handed out again, and what the
job's model never trained is counted, through a lost worker and a restore of a checkpoint."""

from __future__ import annotations

import json

import pytest

from dlrover.sharding import (
    DatasetSpec,
    DeliveryMode,
    InMemoryStreamSource,
    InvalidSpecError,
    Position,
    ShardId,
    ShardManager,
    StreamSpec,
)
from dlrover.sharding.stream import StreamMark, StreamPosition

AT_MOST_ONCE = DeliveryMode.AT_MOST_ONCE


def _stream(manager: ShardManager, records: int = 30) -> InMemoryStreamSource:
    source = InMemoryStreamSource(num_partitions=1)
    source.append(0, records)
    spec = StreamSpec("s", records_per_shard=5, end_offsets=((0, records),), mode=AT_MOST_ONCE)
    manager.register_stream(spec, source)
    return source


def _ranges(manager: ShardManager, worker: str, count: int) -> list[tuple[int, int]]:
    return [(s.start, s.end) for s in manager.fetch_stream_shards("s", worker, count).shards]


def test_a_lost_reader_s_ranges_are_never_handed_out_again_and_count_as_lost() -> None:
    manager = ShardManager(clock=lambda: 0.0)
    _stream(manager)
    assert _ranges(manager, "n0/0", 2) == [(0, 5), (5, 10)]
    manager.report_stream_done("s", "n0/0", [(0, 0)])
    assert manager.recover_node("n0") == 1  # [5, 10) was leased: dropped, not requeued
    progress = manager.stream_progress("s")
    assert progress.lost_records == 5
    assert manager.stream_committed("s") == {0: 10}  # the broker's commit skips the loss
    assert manager.losses() == "at-most-once data lost: stream s 5 records"
    handed = []
    while ranges := _ranges(manager, "n1/0", 4):
        handed += ranges
        manager.report_stream_done("s", "n1/0", [(0, start) for start, _ in ranges])
    assert handed == [(10, 15), (15, 20), (20, 25), (25, 30)]
    assert manager.stream_progress("s").finished


def test_a_restore_counts_what_the_checkpoint_never_trained_once() -> None:
    """Two readers; a checkpoint when each had read one range; then reader 1 dies inside its
    second range and every reader restarts from the checkpoint (at most once: not going back
    to it). Lost is exactly what the restored model never trains: 15 of 30 records, with the
    dropped range counted once, and the rest is read once."""
    manager = ShardManager(clock=lambda: 0.0)
    _stream(manager)
    assert _ranges(manager, "n0/0", 2) == [(0, 5), (5, 10)]
    assert _ranges(manager, "n1/0", 2) == [(10, 15), (15, 20)]
    for worker, first in (("n0/0", 0), ("n1/0", 10)):
        marks = [StreamMark(0, 0, first, 5), StreamMark(5, 0, first + 5, 5)]
        assert manager.mark_stream_ranges("s", worker, marks) == 2
        manager.report_stream_done("s", worker, [(0, first)])
    at = manager.stream_position_at("s", 5)  # the checkpoint: [0, 5) and [10, 15) trained
    assert at.position is not None
    checkpoint = at.position
    assert checkpoint == StreamPosition("s", ((0, 15),), ((0, 5, 10),))
    manager.report_stream_done("s", "n0/0", [(0, 5)])  # trained after the checkpoint
    assert _ranges(manager, "n0/0", 1) == [(20, 25)]
    assert manager.recover_node("n1") == 1  # died 2 records into [15, 20): counted whole
    assert manager.stream_progress("s").lost_records == 5
    assert manager.restore_stream(checkpoint, "round-2")
    # [5, 10) trained after the checkpoint, [15, 20) dropped, [20, 25) leased at the restart.
    assert manager.stream_progress("s").lost_records == 15
    assert not manager.restore_stream(checkpoint, "round-2")  # every rank restores: once
    assert manager.stream_progress("s").lost_records == 15
    assert _ranges(manager, "n0/0", 4) == [(25, 30)]
    manager.report_stream_done("s", "n0/0", [(0, 25)])
    assert manager.stream_progress("s").finished
    # trained: [0, 5) and [10, 15) before the checkpoint, [25, 30) after: 15 + 15 lost = 30


def test_at_most_once_stream_state_survives_a_master_restart() -> None:
    manager = ShardManager(clock=lambda: 0.0)
    source = _stream(manager)
    _ranges(manager, "n0/0", 2)
    manager.recover_node("n0")
    state = json.loads(json.dumps(manager.to_state()))
    again = ShardManager.from_state(state, lambda: 0.0, {"s": source})
    assert again.stream_progress("s").lost_records == 10
    assert _ranges(again, "n1/0", 1) == [(10, 15)]
    assert again.restore_stream(StreamPosition("s", ((0, 0),)), "t")
    # Everything handed out was untrained at that position; the drop is not counted twice.
    assert again.stream_progress("s").lost_records == 15


def _dataset(manager: ShardManager) -> DatasetSpec:
    spec = DatasetSpec("d", size=55, shard_size=10, mode=AT_MOST_ONCE)
    manager.register_dataset(spec)
    return spec


def _shards(manager: ShardManager, worker: str, count: int) -> list[int]:
    return [s.id.index for s in manager.fetch_shards("d", worker, count).shards]


def test_a_lost_worker_s_shards_are_dropped_with_what_it_had_not_reported_trained() -> None:
    manager = ShardManager(clock=lambda: 0.0)
    _dataset(manager)
    assert _shards(manager, "n0/0", 2) == [0, 1]
    assert manager.report_progress("d", "n0/0", ShardId(0, 0), 4)
    assert manager.recover_worker("n0/0") == 2
    progress = manager.dataset_progress("d")
    assert (progress.lost_shards, progress.lost_samples) == (2, 6 + 10)
    assert manager.losses() == "at-most-once data lost: dataset d 16 samples (2 shards)"
    handed = []
    while shards := _shards(manager, "n1/0", 4):
        handed += shards
        manager.report_done("d", "n1/0", [ShardId(0, i) for i in shards])
    assert handed == [2, 3, 4, 5]
    assert manager.dataset_progress("d").finished


def test_a_dataset_restore_counts_what_the_checkpoint_never_trained_once() -> None:
    manager = ShardManager(clock=lambda: 0.0)
    _dataset(manager)
    assert _shards(manager, "n0/0", 2) == [0, 1]
    assert _shards(manager, "n1/0", 2) == [2, 3]
    manager.report_done("d", "n0/0", [ShardId(0, 0)])
    manager.report_done("d", "n1/0", [ShardId(0, 2)])
    checkpoint = Position("d", 0, 3, ((0, 1, 0),))  # shards 0 and 2 trained
    manager.report_done("d", "n0/0", [ShardId(0, 1)])
    assert _shards(manager, "n0/0", 1) == [4]
    assert manager.report_progress("d", "n1/0", ShardId(0, 3), 4)
    assert manager.recover_node("n1") == 1
    assert manager.dataset_progress("d").lost_samples == 6
    assert manager.restore_position(checkpoint, "round-2")
    # Shard 1 (10), shard 3 (10, not 6 + 10) and shard 4 (10): never in the restored model.
    assert manager.dataset_progress("d").lost_samples == 30
    assert _shards(manager, "n0/0", 4) == [5]  # the short last shard, 5 samples
    manager.report_done("d", "n0/0", [ShardId(0, 5)])
    assert manager.dataset_progress("d").finished  # trained 25, lost 30: 55


def test_the_short_last_shard_counts_its_own_length_in_a_shuffled_epoch() -> None:
    manager = ShardManager(clock=lambda: 0.0)
    spec = DatasetSpec("d", size=55, shard_size=10, shuffle=True, seed=3, mode=AT_MOST_ONCE)
    manager.register_dataset(spec)
    everything = _shards(manager, "n0/0", 6)
    assert sorted(everything) == list(range(6))
    assert manager.restore_position(Position("d", 0, 0), "t")
    assert manager.dataset_progress("d").lost_samples == 55


def test_the_mode_has_one_name_on_the_wire_and_in_the_sampler(monkeypatch) -> None:
    from dlrover.trainer.torch.elastic.client_factory import delivery_mode

    assert DeliveryMode("at-most-once") is AT_MOST_ONCE
    monkeypatch.setenv("DLROVER_DELIVERY_MODE", "at-most-once")
    assert delivery_mode(None) is AT_MOST_ONCE
    assert delivery_mode("exactly-once") is DeliveryMode.EXACTLY_ONCE  # the code's own wins
    monkeypatch.setenv("DLROVER_DELIVERY_MODE", "at-most-twice")
    with pytest.raises(InvalidSpecError, match="DLROVER_DELIVERY_MODE 'at-most-twice'"):
        delivery_mode(None)


def test_the_lockstep_sampler_refuses_at_most_once_and_says_what_to_use() -> None:
    from dlrover.testing.sharding import InProcessTransport
    from dlrover.trainer.torch.elastic import DynamicShardSampler

    transport = InProcessTransport(ShardManager())
    with pytest.raises(InvalidSpecError, match="ElasticStreamDataset\\(mode='at-most-once'\\)"):
        DynamicShardSampler(range(10), 1, 0, transport=transport, mode="at-most-once")


def test_dlrover_status_and_the_metrics_show_the_loss() -> None:
    from dlrover.api.wire import job_status_from_pb, job_status_to_pb
    from dlrover.cli.status_view import status_table
    from dlrover.master.job import JobMaster, JobMasterConfig
    from dlrover.master.local_api import LocalMasterApi
    from dlrover.master.metrics import JobMetrics
    from dlrover.master.state_store import MemoryStateStore

    job = JobMaster(JobMasterConfig(job_name="j"), MemoryStateStore())
    api = LocalMasterApi(job)
    assert api.get_job_status().data_lost == ""  # nothing at most once: no line
    job.sharding.register_dataset(DatasetSpec("d", size=55, shard_size=10, mode=AT_MOST_ONCE))
    assert len(job.sharding.fetch_shards("d", "n0/0", 2).shards) == 2
    job.sharding.recover_node("n0")
    status = api.get_job_status()
    line = "at-most-once data lost: dataset d 20 samples (2 shards)"
    assert status.data_lost == line
    assert job_status_from_pb(job_status_to_pb(status)) == status
    assert line in status_table(status).splitlines()
    page = JobMetrics(job).render().decode()
    assert 'dlrover_data_lost{job_name="j",kind="dataset",name="d"} 20.0' in page
