"""Goodput accounting on recorded step/round traces with a fake clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrover.api.master import HeartbeatReport, JoinRequest, Registration
from dlrover.master.goodput import GoodputTracker, StepSample


def test_a_failure_free_job_is_startup_then_productive_then_idle() -> None:
    g = GoodputTracker(now=0.0)
    g.on_round(2.0, 1)
    g.on_step(5.0, 1, 1)  # start-up: master start until the first step was seen
    for t in range(6, 16):  # one step a second
        g.on_step(float(t), 1, t - 4)
    g.on_end(17.0)
    s = g.snapshot(100.0)  # the end freezes the totals
    assert s.elapsed_s == 17.0 and s.steps == 11
    assert s.productive_s == pytest.approx(10.0)
    assert s.badput_s == {
        "startup": 5.0,
        "restart": 0.0,
        "in_process": 0.0,
        "relaunch": 0.0,
        "rollback": 0.0,
        "idle": 2.0,
    }
    assert s.ratio == pytest.approx(10 / 17)
    assert s.step_s == pytest.approx(1.0)


def test_a_restart_counts_the_gap_as_restart_and_redone_steps_as_rollback() -> None:
    recovered: list[tuple[int, float]] = []
    g = GoodputTracker(now=0.0, on_recovered=lambda r, s: recovered.append((r, s)))
    g.on_round(0.0, 1)
    g.on_step(1.0, 1, 1)
    g.on_step(11.0, 1, 11)  # 10 productive seconds, steps 2..11
    # The workers die after step 11; round 2 forms at 13 and resumes from the checkpoint of
    # step 8: steps 9..11 are done again before the job goes on.
    g.on_round(13.0, 2)
    # A heartbeat sent before the restart, arriving late: its workers reported before the
    # round formed, so it is not taken for the new round's.
    g.on_progress(13.2, 2, StepSample(12, 1.5, 5, 8.0))
    g.on_step(15.0, 2, 9)  # the round's first step seen: 11 -> 15 was the restart
    g.on_step(17.0, 2, 11)  # re-doing 10, 11: rollback
    g.on_step(19.0, 2, 13)  # 12, 13 are new: productive; recovered at 19
    s = g.snapshot(19.0)
    assert s.productive_s == pytest.approx(10.0 + 2.0)
    assert s.badput_s["restart"] == pytest.approx(4.0)
    assert s.badput_s["rollback"] == pytest.approx(2.0)
    assert s.recoveries_s == pytest.approx((8.0,))  # last progress 11 -> past step 11 at 19
    assert g.recovery_of(2) == pytest.approx(8.0)  # what the failure before round 2 cost
    assert recovered == [(2, pytest.approx(8.0))]  # told once (the master keeps it)
    assert g.recovery_of(1) == 0.0
    assert s.ratio == pytest.approx(12.0 / 19.0)


def test_each_recovery_s_gap_goes_to_the_bucket_of_how_it_was_recovered() -> None:
    """In-process recovery, then a restart in place, then a relaunch after an in-process
    recovery before the same round (the costliest counts), then a re-form without failure."""
    g = GoodputTracker(now=0.0)
    g.on_round(0.0, 1)
    g.on_step(0.0, 1, 0)
    t, step = 0.0, 0
    for rnd, (actions, gap) in enumerate(
        [
            (["recover_in_process"], 0.5),
            (["restart_processes"], 2.0),
            (["recover_in_process", "relaunch_node"], 30.0),
            ([], 4.0),
        ],
        start=2,
    ):
        step += 5
        t += 5.0
        g.on_step(t, rnd - 1, step)
        for action in actions:
            g.on_failure(action)
        g.on_round(t, rnd)
        t += gap
        g.on_step(t, rnd, step + 1)
        step += 1
    s = g.snapshot(t)
    assert s.badput_s["in_process"] == pytest.approx(0.5)
    assert s.badput_s["restart"] == pytest.approx(2.0 + 4.0)
    assert s.badput_s["relaunch"] == pytest.approx(30.0)


def test_a_span_that_redoes_and_goes_past_is_split_by_steps() -> None:
    g = GoodputTracker(now=0.0)
    g.on_round(0.0, 1)
    g.on_step(0.0, 1, 0)
    g.on_step(10.0, 1, 10)
    g.on_round(10.0, 2)
    g.on_step(12.0, 2, 6)
    g.on_step(20.0, 2, 14)  # 7..10 again (half the steps), 11..14 new (the other half)
    s = g.snapshot(20.0)
    assert s.badput_s["rollback"] == pytest.approx(4.0)
    assert s.productive_s == pytest.approx(10.0 + 4.0)


def test_a_job_that_never_trains_is_all_startup() -> None:
    g = GoodputTracker(now=0.0)
    g.on_end(30.0)
    s = g.snapshot(40.0)
    assert s.ratio == 0.0 and s.badput_s["startup"] == 30.0 and s.steps == 0


def test_history_keeps_a_point_every_five_seconds() -> None:
    g = GoodputTracker(now=0.0)
    for t in range(0, 21):
        g.sample(float(t), 1000.0 + t)
    assert [wall for wall, _ in g.history()] == [1000.0, 1005.0, 1010.0, 1015.0, 1020.0]


def test_step_times_come_from_the_samples_not_the_heartbeats() -> None:
    """One heartbeat can carry a whole short round: its first and latest step times split the
    round's start-up from its steps, whatever the heartbeat interval."""
    g = GoodputTracker(now=0.0)
    g.on_round(1.0, 1)
    # Sent at 10: the workers first reported step 1 at 4 (6 s ago), step 21 at 9 (1 s ago).
    g.on_progress(10.0, 1, StepSample(21, 1.0, 1, 6.0))
    s = g.snapshot(10.0)
    assert s.badput_s["startup"] == pytest.approx(4.0)
    assert s.productive_s == pytest.approx(5.0) and s.step_s == pytest.approx(0.25)


def test_a_resumed_round_counts_the_workers_that_kept_training() -> None:
    """A master restarted at 100 takes over round 3, whose workers trained all along (from step
    10 at 50, one step a second): their heartbeats count from the master's start on."""
    g = GoodputTracker(now=100.0)
    g.on_round(100.0, 3, resumed=True)
    g.on_progress(102.0, 3, StepSample(60, 0.0, 10, 52.0))  # step 60 at 102 (first: 10 at 50)
    g.on_progress(104.0, 3, StepSample(62, 0.0, 10, 54.0))
    s = g.snapshot(104.0)
    assert s.productive_s == pytest.approx(4.0)  # every second since the master started
    assert s.steps == 62 and s.step_s == pytest.approx(1.0)
    assert sum(s.badput_s.values()) == pytest.approx(0.0)
    assert s.ratio == pytest.approx(1.0)

    # The next round is a real restart: a late heartbeat of round 3's workers is not counted.
    g.on_round(106.0, 4)
    g.on_progress(106.5, 4, StepSample(64, 0.5, 10, 56.5))
    assert g.snapshot(106.5).productive_s == pytest.approx(4.0)


def test_a_restarted_master_counts_goodput_of_the_round_it_took_over(tmp_path: Path) -> None:
    """The JobMaster rebuilt on a state with a closed round resumes that round's goodput."""
    from dlrover.master.job import JobMaster, JobMasterConfig
    from dlrover.master.rendezvous import RendezvousConfig
    from dlrover.master.state_store import SqliteStateStore

    now = [0.0]
    config = JobMasterConfig("g", RendezvousConfig(1, 1))
    store = SqliteStateStore(str(tmp_path / "state.db"))
    job = JobMaster(config, store, clock=lambda: now[0])
    node = job.members.register_node(Registration("h", 1, "n0", "default", -1, 1))
    job.members.join_rendezvous(
        JoinRequest(node.node_id, node.incarnation, 1, "h", 1)
    )  # max nodes: the round closes at once
    assert job.rendezvous is not None and job.rendezvous.world is not None
    store.close()

    now[0] = 100.0  # the master restarts; its node trained from step 0 at 40
    store = SqliteStateStore(str(tmp_path / "state.db"))
    job = JobMaster(config, store, clock=lambda: now[0])
    now[0] = 110.0
    job.members.heartbeat(
        HeartbeatReport(
            "n0",
            node.incarnation,
            cpu_percent=0.0,
            memory_bytes=0,
            step=70,
            restart_count=0,
            attempt_step=70,
            attempt_step_age_s=0.0,
            attempt_first_step=0,
            attempt_first_age_s=70.0,
        )
    )
    assert job.diagnostics.goodput.snapshot(110.0).productive_s == pytest.approx(10.0)
    store.close()
