"""Hang detection's policy: the spec a user writes, timeouts learned per phase, and the stack
evidence that confirms a learned one (a pure `HangWatch` fed by hand, with a fake clock)."""

from __future__ import annotations

import pytest

from dlrover.agent.hang_watch import HangWatch, stack_signature, waits_in_collective
from dlrover.hang_spec import HangSpec, HangSpecError, PhaseHistory
from dlrover.trainer.progress import SectionRecord, StepRecord

LOOP = """Current thread 0x00007f (most recent call first):
  File "/job/train.py", line 40 in spin
  File "/job/train.py", line 90 in main
"""
SLEEP = """Current thread 0x00007f (most recent call first):
  File "/job/train.py", line 20 in wait
  File "/job/train.py", line 90 in main
"""
EVAL_A = """Current thread 0x00007f (most recent call first):
  File "/site/torch/nn/modules/linear.py", line 125 in forward
  File "/job/train.py", line 60 in evaluate
"""
EVAL_B = """Current thread 0x00007f (most recent call first):
  File "/site/torch/nn/functional.py", line 2200 in softmax
  File "/job/train.py", line 61 in evaluate
"""
ALL_REDUCE = """Current thread 0x00007f (most recent call first):
  File "/site/torch/distributed/distributed_c10d.py", line 2800 in all_reduce
  File "/job/train.py", line 70 in main
"""


def step(n: int, at: float) -> StepRecord:
    return StepRecord(n, at, 0.0)


def test_the_spec_reads_what_users_write_and_refuses_the_rest_clearly() -> None:
    assert HangSpec.parse("auto") == HangSpec() == HangSpec.parse(None)
    assert not HangSpec.parse("0").enabled and not HangSpec.parse("off").enabled
    assert HangSpec.parse("30").every == 30 and HangSpec.parse(30).text() == "30"
    spec = HangSpec.parse("step=120,eval=off,min=10,max=900")
    assert spec.fixed == {"step": 120.0, "eval": 0.0} and (spec.floor, spec.cap) == (10, 900)
    assert HangSpec.parse(spec.text()) == spec
    assert HangSpec.parse({"step": 120, "min": 5}).text() == "step=120,min=5"
    for bad, says in (
        ("-1", "must be seconds >= 0"),
        ("step=soon", "not a number"),
        ("step", "expected auto"),
        ("min=10,max=5", "above max"),
        ("st ep=4", "not a phase name"),
    ):
        with pytest.raises(HangSpecError, match=says):
            HangSpec.parse(bad)


def test_a_timeout_is_learned_from_the_phase_s_own_durations_between_floor_and_cap() -> None:
    history = PhaseHistory()
    spec = HangSpec()
    assert spec.timeout("step", history) == (300.0, True)  # the default before 10 steps
    history.add("step", 0.5, count=999)
    history.add("step", 40.0)  # the one slow step of 1,000 is above the 99th percentile
    assert history.p99("step") == 0.5
    assert spec.timeout("step", history) == (60.0, True)  # 3 x 0.5 s, raised to the floor
    assert HangSpec.parse("min=1").timeout("step", history) == (1.5, True)
    for _ in range(30):
        history.add("step", 100.0)  # slow steps are now 3% of them
    assert spec.timeout("step", history) == (300.0, True)
    assert HangSpec.parse("max=200").timeout("step", history) == (200.0, True)
    assert HangSpec.parse("step=7").timeout("step", history) == (7.0, False)
    assert HangSpec.parse("7").timeout("startup", history) == (1800.0, True)  # from a step on
    saved = PhaseHistory.decode(history.encode())
    assert saved.count("step") == 1030 and saved.p99("step") == history.p99("step")
    assert PhaseHistory.decode(b"not json").phases() == []


def test_steps_and_sections_teach_their_phases_and_a_section_is_not_a_step() -> None:
    watch = HangWatch(HangSpec(), PhaseHistory(), 1, started_at=0.0)
    watch.observe(0, step(1, 20.0), None, 20.0)  # the first step came 20 s after the start
    for n in range(2, 12):
        watch.observe(0, step(n, 20.0 + n - 1), None, 20.0 + n)
    assert watch.history.count("startup") == 1 and watch.history.p99("startup") == 20.0
    assert watch.history.count("step") == 10 and watch.history.p99("step") == 1.0
    evaluating = SectionRecord("eval", 31.0, "", 0.0, 0.0, 0, 0.0)
    watch.observe(0, step(11, 30.0), evaluating, 100.0)
    assert watch.phase_of(0, 100.0) == ("eval", 69.0)
    done = SectionRecord("", 0.0, "eval", 120.0, 151.0, 0, 0.0)
    watch.observe(0, step(12, 152.0), done, 152.0)
    assert watch.history.p99("eval") == 120.0
    assert watch.history.count("step") == 10  # the step around the evaluation is not learned


def test_optimizer_beats_are_progress_for_a_script_that_reports_no_step() -> None:
    watch = HangWatch(HangSpec(), PhaseHistory(), 1, started_at=0.0)
    for beats in range(1, 13):
        watch.observe(
            0, None, SectionRecord("", 0.0, "", 0.0, 0.0, beats, 5.0 + beats), 6.0 + beats
        )
    assert watch.history.p99("startup") == 6.0
    assert watch.history.count("step") == 11 and watch.history.p99("step") == 1.0
    assert watch.phase_of(0, 30.0) == ("step", 13.0)


def test_a_learned_timeout_is_confirmed_by_a_stack_that_stopped_changing() -> None:
    history = PhaseHistory()
    history.add("step", 0.2, count=100)
    watch = HangWatch(HangSpec.parse("min=8"), history, 3, started_at=0.0)
    for lr in (0, 1, 2):
        watch.observe(lr, step(5, 10.0), None, 10.0)
    assert watch.due(11.9, set()) == []  # younger than a quarter of the 8 s timeout
    due = watch.due(12.0, set())
    assert [(d.local_rank, d.fixed) for d in due] == [(0, False), (1, False), (2, False)]
    evals = (EVAL_A, EVAL_B)
    for i, now in enumerate((12.0, 13.0, 14.0, 15.0, 16.0, 17.0, 18.0)):
        if i:
            assert watch.due(now - 0.1, set()) == []  # samples an eighth of the timeout apart
        watch.sample(0, SLEEP, 1.0, now)  # rank 0 waits for something in its own code, idle
        watch.sample(1, evals[i % 2], 50.0 + i, now)  # rank 1 evaluates, unmarked
        watch.sample(2, LOOP, 100.0 + i, now)  # rank 2 spins, a core busy
    assert watch.hung(17.9, set(), whole_world_here=True) == []  # not yet 8 s old
    hangs = watch.hung(18.0, set(), whole_world_here=True)
    assert [h.local_rank for h in hangs] == [0]
    assert "not changed for 6s" in hangs[0].reason and "train.py:wait" in hangs[0].reason
    assert "learned from 100 durations" in hangs[0].reason
    # a busy rank whose stack stands still (a spin, or one long call) gets 5x the floor: 40 s
    for i, now in enumerate((30.0, 40.0, 50.0)):
        watch.sample(1, evals[i % 2], 50.0 + now, now)
        watch.sample(2, LOOP, 100.0 + 6 + (now - 18.0), now)  # one core
    assert [h.local_rank for h in watch.hung(49.0, {0}, whole_world_here=True)] == []
    spin = watch.hung(50.0, {0}, whole_world_here=True)
    assert [h.local_rank for h in spin] == [2] and "busy at 100% of a core, bound 40s" in spin[
        0
    ].reason


def test_a_rank_waiting_in_a_collective_is_left_to_the_laggard_s_agent() -> None:
    history = PhaseHistory()
    history.add("step", 0.2, count=100)
    spec = HangSpec.parse("min=4")
    # rank 1 of two, alone on this node, waits for rank 0 (elsewhere) for ever
    watch = HangWatch(spec, history, 1, started_at=0.0)
    watch.observe(0, step(5, 10.0), None, 10.0)
    for now in (12.0, 13.0, 14.0, 15.0, 30.0):
        watch.sample(0, ALL_REDUCE, 1.0, now)
    assert watch.hung(30.0, set(), whole_world_here=False) == []
    # ... but says what it waits in, once per stall, for the master to name the laggard
    assert watch.witnesses(30.0, set(), whole_world_here=True) == []  # its own verdicts say it
    witnesses = watch.witnesses(30.0, set(), whole_world_here=False)
    assert [w.local_rank for w in witnesses] == [0] and "another node" in witnesses[0].reason
    assert watch.witnesses(31.0, set(), whole_world_here=False) == []  # once per stall
    # both ranks on this node wait: a deadlock, whoever skipped the collective
    watch = HangWatch(spec, history, 2, started_at=0.0)
    for lr in (0, 1):
        watch.observe(lr, step(5, 10.0), None, 10.0)
        for now in (12.0, 14.0):
            watch.sample(lr, ALL_REDUCE, 1.0, now)
    hangs = watch.hung(14.0, set(), whole_world_here=True)
    assert [h.local_rank for h in hangs] == [0, 1] and "deadlock" in hangs[0].reason
    # a rank of this node still works (the one the other may wait for): nothing to witness
    watch = HangWatch(spec, history, 2, started_at=0.0)
    for lr in (0, 1):
        watch.observe(lr, step(5, 10.0), None, 10.0)
    for i, now in enumerate((12.0, 13.0, 14.0, 15.0)):
        watch.sample(0, ALL_REDUCE, 1.0, now)
        watch.sample(1, (EVAL_A, EVAL_B)[i % 2], 1.0 + now, now)
    assert watch.witnesses(15.0, set(), whole_world_here=False) == []
    assert watch.hung(15.0, set(), whole_world_here=False) == []
    # the rank it waited for has exited
    watch = HangWatch(spec, history, 2, started_at=0.0)
    watch.observe(0, step(5, 10.0), None, 10.0)
    for now in (12.0, 14.0):
        watch.sample(0, ALL_REDUCE, 1.0, now)
    assert "has exited" in watch.hung(14.0, {1}, whole_world_here=True)[0].reason


def test_a_fixed_timeout_is_obeyed_without_evidence_and_a_stopped_rank_never_answers() -> None:
    watch = HangWatch(HangSpec.parse("5"), PhaseHistory(), 1, started_at=0.0)
    assert watch.due(100.0, set()) == []  # start-up is not the fixed timeout's: no step yet
    watch.observe(0, step(1, 10.0), None, 10.0)
    assert watch.due(15.0, set()) == []
    assert [(d.phase, d.fixed) for d in watch.due(15.5, set())] == [("step", True)]
    assert watch.due(15.5, {0}) == []
    stopped = "(no stack dump within 2s: the process may be stuck in native code)"
    assert stack_signature(stopped) == (stopped,)
    assert not waits_in_collective(stack_signature(stopped), 0.0)
    assert waits_in_collective(stack_signature(ALL_REDUCE), None)
    backward = '  File "/site/torch/autograd/graph.py", line 8 in _engine_run_backward\n'
    assert waits_in_collective(stack_signature(backward), 0.0)
    assert not waits_in_collective(stack_signature(backward), 0.9)  # computing
