"""Runtime straggler scores (master) and the node step times they are made of (agent)."""

from __future__ import annotations

import pytest

from dlrover.agent.progress_watch import StepTimes
from dlrover.master.stragglers import StragglerWatch
from dlrover.trainer.progress import StepRecord, StepReporter, read_step_file, report_step


def test_a_node_below_the_threshold_for_three_reports_in_a_row_is_a_straggler() -> None:
    now = [0.0]
    watch = StragglerWatch(lambda: now[0], report_s=60)
    assert not watch.due()
    members = ["a", "b", "c"]
    flagged = []
    for report, slow in enumerate([0.3, 0.5, 0.1, 0.31, 0.32, 0.33, 0.34]):
        watch.observe("a", 0.1)
        watch.observe("b", slow)
        watch.observe("c", 0.11)
        now[0] += 60
        assert watch.due() and not watch.due()
        scores, new = watch.report(members)
        by = {s.node_id: s for s in scores}
        assert by["a"].relative == pytest.approx(1.0)
        assert by["b"].relative == pytest.approx(0.1 / slow)
        flagged += [(report, n) for n in new]
    # Low at reports 0 and 1, fine at 2 (0.1 s/step), low again at 3, 4, 5: flagged at 5, once.
    assert flagged == [(5, "b")]
    assert watch.scores["b"].low_reports == 4
    assert watch.scores["b"].individual == pytest.approx(0.1 / 0.34)  # its own best was 0.1


def test_nodes_without_step_times_are_not_scored_and_a_replacement_starts_fresh() -> None:
    watch = StragglerWatch(lambda: 0.0)
    watch.observe("a", 0.0)  # not measured yet
    watch.observe("b", 0.2)
    scores, _ = watch.report(["a", "b"])
    assert [s.node_id for s in scores] == ["b"]
    watch.forget("b")
    assert watch.report(["a", "b"]) == ([], [])


def test_step_times_are_the_slowest_local_worker_busy_seconds_per_step() -> None:
    times = StepTimes(window_s=10)
    times.observe(0, StepRecord(1, 0.0, 1.0), now=0.0)
    times.observe(1, StepRecord(1, 0.0, 2.0), now=0.0)
    times.observe(0, StepRecord(11, 0.0, 2.0), now=5.0)  # window still open
    assert times.step_time_s == 0.0
    times.observe(1, StepRecord(11, 0.0, 5.0), now=10.0)
    assert times.step_time_s == pytest.approx(0.3)  # rank 1: 3 s over 10 steps; rank 0: 0.1
    times.observe(0, StepRecord(21, 0.0, 3.0), now=20.0)
    assert times.step_time_s == pytest.approx(0.1)  # only rank 0 stepped in the new window


def test_the_step_file_carries_busy_seconds(tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "step")
    reporter = StepReporter(path)
    reporter.report(1, busy_s=0.25)
    reporter.report(2, busy_s=0.5)
    record = read_step_file(path)
    assert record is not None and (record.step, record.busy_s) == (2, 0.75)
    reporter.close()
    monkeypatch.setenv("DLROVER_STEP_FILE", path)
    report_step(3, busy_s=0.25)  # the stateless call adds to what the file holds
    record = read_step_file(path)
    assert record is not None and (record.step, record.busy_s) == (3, 1.0)
    report_step(4)  # without busy_s: the process's CPU seconds
    record = read_step_file(path)
    assert record is not None and record.step == 4 and record.busy_s > 0


def test_step_breakdown_is_the_slowest_workers_wall_time_and_its_parts() -> None:
    from dlrover.agent.progress_watch import StepBreakdown

    times = StepTimes(window_s=10.0, breakdown_window_s=10.0)
    # rank 0: 10 steps in 5 s, 1 s of it waiting for data; rank 1: 10 steps in 8 s, 2 s in
    # checkpoint saves. The node is as slow as rank 1.
    times.observe(0, StepRecord(1, 100.0, 0.0, 1, 100.0, 0.0, 0.0), now=0.0)
    times.observe(1, StepRecord(1, 100.0, 0.0, 1, 100.0, 0.0, 0.0), now=0.0)
    times.observe(0, StepRecord(11, 105.0, 0.0, 1, 100.0, 1.0, 0.0), now=9.0)
    times.observe(1, StepRecord(11, 108.0, 0.0, 1, 100.0, 0.0, 2.0), now=9.0)
    times.observe(0, StepRecord(11, 105.0, 0.0, 1, 100.0, 1.0, 0.0), now=10.0)  # window closes
    assert times.breakdown == pytest.approx(StepBreakdown(0.8, 0.0, 0.2))


def test_scrapes_read_the_scores_under_the_jobs_lock() -> None:
    """The tick replaces the scores and a departing node is popped from them under the job's
    lock; /metrics and the status (other threads) must copy them under it too."""
    from collections.abc import ItemsView, Iterator, KeysView

    from dlrover.master.job import JobMaster, JobMasterConfig
    from dlrover.master.local_api import LocalMasterApi
    from dlrover.master.metrics import JobMetrics
    from dlrover.master.state_store import MemoryStateStore
    from dlrover.master.stragglers import Score

    job = JobMaster(JobMasterConfig("s"), MemoryStateStore())
    locked: list[bool] = []

    class Scores(dict[str, Score]):
        """Records, on every read, whether this thread holds the job's lock."""

        def _read(self) -> None:
            locked.append(job._lock._is_owned())  # type: ignore[attr-defined]

        def __iter__(self) -> Iterator[str]:
            self._read()
            return super().__iter__()

        def keys(self) -> KeysView[str]:  # type: ignore[override]
            self._read()
            return super().keys()

        def items(self) -> ItemsView[str, Score]:  # type: ignore[override]
            self._read()
            return super().items()

    job.diagnostics.stragglers.scores = Scores(a=Score("a", 0.1, 1.0, 1.0, 0))
    assert b'dlrover_straggler_score{job_name="s",node="a"} 1.0' in JobMetrics(job).render()
    LocalMasterApi(job).get_job_status()
    assert locked and all(locked), locked
