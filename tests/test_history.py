"""The job over time for the dashboard's charts (`JobHistory`), and the samples per second a
node's heartbeat carries (`StepTimes`)."""

from __future__ import annotations

import pytest

from dlrover.agent.progress_watch import StepTimes
from dlrover.api.master import HeartbeatReport, Registration
from dlrover.master.history import NODE_SERIES, JobHistory
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.rendezvous import RendezvousConfig
from dlrover.master.state_store import MemoryStateStore
from dlrover.trainer.progress import StepRecord, StepReporter, read_step_file


def _job() -> tuple[JobMaster, list[float]]:
    now = [0.0]
    job = JobMaster(
        JobMasterConfig("hist", RendezvousConfig(1, 2)), MemoryStateStore(), clock=lambda: now[0]
    )
    for node in ("n0", "n1"):
        job.members.register_node(Registration("h", 1, node, "default", -1, 1))
    return job, now


def _beat(job: JobMaster, node: str, step_wall_s: float, samples_per_s: float) -> None:
    incarnation = job.members.nodes.get(node).incarnation
    job.members.heartbeat(
        HeartbeatReport(
            node, incarnation, cpu_percent=50.0, memory_bytes=2**30, step_wall_s=step_wall_s,
            samples_per_s=samples_per_s,
        )
    )  # fmt: skip


def test_each_node_is_a_column_over_one_time_axis() -> None:
    job, now = _job()
    history = JobHistory(job, every_s=1.0)
    _beat(job, "n0", 0.5, 64.0)
    _beat(job, "n1", 0.25, 128.0)
    history.maybe_sample(now[0])
    history.maybe_sample(now[0] + 0.5)  # within the interval: no sample
    now[0] = 1.0
    job.members.lose("n1", "gone")
    history.maybe_sample(now[0])
    doc = history.document()
    assert len(doc["t"]) == 2 and len(doc["goodput"]) == 2
    n0, n1 = doc["nodes"]["n0"], doc["nodes"]["n1"]
    assert set(n0) == set(NODE_SERIES)
    assert n0["step_s"] == [0.5, 0.5] and n0["samples_per_s"] == [64.0, 64.0]
    assert n0["steps_per_s"] == [2.0, 2.0] and n0["memory_mib"] == [1024.0, 1024.0]
    # n1 left: null from then on, so its line stops instead of dropping to zero.
    assert n1["samples_per_s"] == [128.0, None] and n1["cpu_percent"] == [50.0, None]
    # The loss is a marker, taken once however often the history samples.
    history.sample(now[0])
    lost = [m for m in history.document()["markers"] if "n1 lost" in m["text"]]
    assert len(lost) == 1 and lost[0]["kind"] == "node"


def test_a_long_job_is_kept_whole_at_a_falling_resolution() -> None:
    job, now = _job()
    history = JobHistory(job, every_s=1.0, max_points=8)
    for second in range(40):
        now[0] = float(second)
        history.maybe_sample(now[0])
    doc = history.document()
    assert len(doc["t"]) < 8  # bounded
    assert history.every_s > 1.0  # the interval doubled as the points filled up
    # The first sample and the latest are both kept: the chart spans the whole job.
    t = doc["t"]
    assert t == sorted(t) and t[-1] - t[0] >= 0.0


def test_interval_shares_never_exceed_the_interval() -> None:
    """Steps credited late (heartbeats) may give an interval more productive time than its span;
    its parts are scaled to it, so the stacked chart stays within 100%."""
    job, now = _job()
    history = JobHistory(job, every_s=1.0)
    job.diagnostics.goodput.on_round(0.0, 1)
    for second in range(5):
        now[0] = float(second)
        job.diagnostics.goodput.on_step(now[0], 1, second * 10)
        history.sample(now[0])
    shares = history.document()["shares"]
    assert shares["productive"][0] is None  # no interval before the first sample
    for i in range(1, 5):
        total = sum(column[i] for column in shares.values())
        assert 0.0 <= total <= 1.0 + 1e-9


def test_max_points_below_four_is_refused() -> None:
    job, _ = _job()
    with pytest.raises(ValueError, match="at least 4"):
        JobHistory(job, max_points=2)


def test_samples_per_second_add_up_over_a_nodes_workers(tmp_path: object) -> None:
    times = StepTimes(window_s=10.0, breakdown_window_s=2.0)
    # Two workers: 16 and 32 samples per step, 0.1 s per step.
    for rank, batch in ((0, 16), (1, 32)):
        times.observe(rank, StepRecord(10, 100.0, 0.0, samples=10 * batch), now=0.0)
    times.observe(1, StepRecord(30, 102.0, 0.0, samples=30 * 32), now=1.9)
    times.observe(0, StepRecord(30, 102.0, 0.0, samples=30 * 16), now=2.0)  # the window closes
    assert times.breakdown.samples_per_s == pytest.approx(20 * 16 / 2.0 + 20 * 32 / 2.0)
    assert times.breakdown.wall_s == pytest.approx(0.1)


def test_a_step_report_carries_its_samples(tmp_path: object) -> None:
    import pathlib

    path = pathlib.Path(str(tmp_path)) / "step"
    reporter = StepReporter(str(path))
    reporter.report(1, samples=8)
    reporter.report(2, samples=8)
    reporter.close()
    record = read_step_file(str(path))
    assert record is not None and record.step == 2 and record.samples == 16
    # A record of an older writer (no samples field) still reads, with 0 samples.
    path.write_bytes(path.read_bytes()[:-8])
    older = read_step_file(str(path))
    assert older is not None and older.step == 2 and older.samples == 0


def test_a_large_job_charts_its_lowest_ranks_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from dlrover.master import history as history_module

    monkeypatch.setattr(history_module, "MAX_CHARTED_NODES", 1)
    job, now = _job()
    history = JobHistory(job)
    history.sample(now[0])
    assert list(history.document()["nodes"]) == ["n0"]  # registered first: the lower rank


def test_a_large_job_charts_its_first_nodes_by_rank_and_copies_only_those() -> None:
    """The charts show at most MAX_CHARTED_NODES alive nodes, ranked ones first in node-rank
    order, then the others by id (`NodeTable.first_alive`); what it returns are copies, and
    `all()` copies every field as `dataclasses.replace` does."""
    import dataclasses

    from dlrover.master.history import MAX_CHARTED_NODES
    from dlrover.master.nodes import NodeState, NodeTable

    table = NodeTable(MemoryStateStore(), lambda: 0.0)
    for i in range(MAX_CHARTED_NODES + 40):
        table.register(f"n{i:03d}", "h", "worker", 1, -1, i)
    ranks = {f"n{i:03d}": MAX_CHARTED_NODES + 39 - i for i in range(0, MAX_CHARTED_NODES + 40, 2)}
    table.activate(ranks, "member of round 1")  # the even ones, in reverse rank order
    table.set_state("n000", NodeState.SUCCEEDED, "done")  # not alive: never charted
    first = table.first_alive(MAX_CHARTED_NODES)
    ranked = sorted((n for n in ranks if n != "n000"), key=lambda n: ranks[n])
    unranked = sorted(f"n{i:03d}" for i in range(1, MAX_CHARTED_NODES + 40, 2))
    assert [n.node_id for n in first] == (ranked + unranked)[:MAX_CHARTED_NODES]
    first[0].step = 12345  # a copy: the table keeps its own
    assert table.get(first[0].node_id).step != 12345
    assert table.all() == [dataclasses.replace(n) for n in table.all()]
