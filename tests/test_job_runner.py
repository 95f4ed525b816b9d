"""JobRunner, the library object that runs a job: start, step, outcome, and its record, driven
here on a FakeEngine (the end-to-end runs through `dlrover submit` are tests/e2e/test_submit.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrover.engines.base import FailureReason
from dlrover.jobspec import job_spec_from_dict
from dlrover.runner import (
    EngineStartError,
    JobAlreadyRunningError,
    JobRunner,
    JobSettingsError,
    RunnerSettings,
)
from dlrover.runner.records import JobRecord, read_final, read_history, read_record, write_record
from dlrover.testing.fake_engine import FakeEngine

SETTINGS = RunnerSettings(host="127.0.0.1", token="tok", metrics_port=None)


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DLROVER_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _spec(**extra: object):
    return job_spec_from_dict({"name": "lib", "entrypoint": "train.py", "nodes": 2, **extra})


def test_start_serves_the_master_records_the_job_and_launches_every_node():
    engine = FakeEngine()
    seen: list[str] = []
    runner = JobRunner(_spec(), SETTINGS, engine=engine, on_serving=lambda r: seen.append(r.token))
    assert runner.start()
    try:
        assert seen == ["tok"]  # told before any node was launched
        assert [s.node_id for s in engine.launched] == ["lib-worker-0-0", "lib-worker-1-0"]
        assert engine.launched[0].env["DLROVER_MASTER_ADDR"] == runner.master_addr
        assert runner.master_addr == f"127.0.0.1:{runner.master.port}"  # local: loopback
        record = read_record("lib")
        assert (record.state, record.master_addr, record.token) == (
            "running",
            runner.master_addr,
            "tok",
        )
        assert runner.step(0.0) and runner.running
    finally:
        runner.stop("test over")
        outcome = runner.run()
    assert (outcome.state, outcome.reason, outcome.exit_code) == ("failed", "test over", 1)
    assert engine.closed and sorted(engine.deleted) == ["lib-worker-0-0", "lib-worker-1-0"]
    assert read_record("lib").state == "failed"


def test_a_node_failing_past_its_relaunches_ends_the_run_with_the_jobs_failure():
    engine = FakeEngine()
    runner = JobRunner(_spec(max_relaunches=0), SETTINGS, engine=engine)
    assert runner.start()
    engine.fail("lib-worker-1-0", FailureReason.EXIT_CODE, exit_code=7)
    outcome = runner.run(poll_s=0.05)
    assert outcome.state == "failed" and outcome.exit_code >= 1
    assert "lib-worker-1-0" in outcome.reason
    assert len(engine.launched) == 2  # nothing relaunched
    record = read_record("lib")
    assert record == JobRecord(
        name="lib",
        state="failed",
        pid=record.pid,
        reason=outcome.reason,
        exit_code=runner.job.lifecycle.exit_code,
        engine="local",
        started_at=record.started_at,
        ended_at=record.ended_at,
    )
    assert 0 < record.started_at <= record.ended_at  # the jobs page's started and ended
    # ... and its charts: the history it left, up to its end.
    history = read_history("lib")
    assert history is not None and len(history["t"]) >= 1
    assert history["t"][-1] <= record.ended_at
    # What `dlrover status` prints of it now: the last table and the failure.
    final = read_final("lib")
    assert final is not None and final.status.state == "failed"
    assert [(f.node_id, f.action) for f in final.failures] == [("lib-worker-1-0", "fail")]
    assert final.status.reason == outcome.reason


def test_a_live_master_of_the_same_job_is_refused_before_anything_starts():
    import os

    write_record(JobRecord(name="lib", state="running", pid=os.getppid(), master_addr="h:1"))
    engine = FakeEngine()
    with pytest.raises(JobAlreadyRunningError, match="already running .*dlrover stop lib"):
        JobRunner(_spec(), SETTINGS, engine=engine).start()
    assert engine.launched == []


def test_bad_settings_and_an_engine_that_cannot_start_are_clear_errors(
    monkeypatch: pytest.MonkeyPatch,
):
    monkeypatch.setenv("DLROVER_AUTOSCALE_INTERVAL_S", "soon")
    with pytest.raises(JobSettingsError, match="DLROVER_AUTOSCALE_INTERVAL_S='soon'") as error:
        JobRunner(_spec(auto_scale=True), SETTINGS, engine=FakeEngine()).start()
    assert error.value.exit_code == 2
    monkeypatch.delenv("DLROVER_AUTOSCALE_INTERVAL_S")
    spec = job_spec_from_dict({"name": "kube", "entrypoint": "t.py", "engine": "kubernetes"})
    with pytest.raises(EngineStartError, match="cannot start engine kubernetes: .*image"):
        JobRunner(spec, SETTINGS).start()
    assert read_record("kube").state == "failed"
