"""The agent stepped by hand against an in-process master (LocalMasterApi: no server, no
master process); its workers are real processes."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from dlrover.agent.agent import ElasticAgent
from dlrover.agent.config import AgentConfig
from dlrover.agent.failure_policy import WorkerGroupState
from dlrover.api.master import JoinRequest, Registration
from dlrover.master.job import JobMaster, JobMasterConfig, JobState
from dlrover.master.local_api import LocalMasterApi
from dlrover.master.state_store import MemoryStateStore

# Local rank 1 fails on the first attempt only.
WORKER = """
import os, sys
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["LOCAL_RANK"] == "1":
    sys.exit(3)
"""


def test_one_step_per_round_restarts_then_succeeds():
    job = JobMaster(JobMasterConfig(job_name="stepped"), MemoryStateStore())
    config = AgentConfig(
        entrypoint=[sys.executable, "-c", WORKER],
        nproc_per_node=2,
        max_restarts=2,
        fast_restart=False,
        flash_checkpoint=False,
        hang_warning_timeout_s=0,
        monitor_interval_s=0.05,
    )
    agent = ElasticAgent(config, LocalMasterApi(job), "127.0.0.1:1", "token")
    agent.start()
    try:
        assert agent.run_id == "stepped"  # no --rdzv-id: the master's job name
        assert agent.step() is None  # rank 1 exited 3: the group restarts
        assert (agent.restart_count, agent.state) == (1, WorkerGroupState.RESTARTING)
        result = agent.step()
        assert result is not None and result.exit_code == 0
        assert agent.state is WorkerGroupState.SUCCEEDED
        assert job.lifecycle.state is JobState.SUCCEEDED
    finally:
        agent.close()


# The first attempt raises when the world re-forms under it (SIGTERM), the next at once: the
# same user error both times, at the same place.
RAISES_AS_IT_REFORMS = """
import os, signal, sys, time
def bad(*_):
    raise ValueError("bad learning rate")
if os.environ["DLROVER_RDZV_ROUND"] == "1":
    signal.signal(signal.SIGTERM, bad)
    open(sys.argv[1], "w").close()
    while True:
        time.sleep(1)
bad()
"""


def _bootstrapped_agent(
    job: JobMaster, script: Path, ready: Path, max_restarts: int
) -> ElasticAgent:
    """An agent of one worker (1..2 nodes) running ``script READY`` as dlrover-run starts a
    script: the bootstrap writes each rank's error file."""
    config = AgentConfig(
        entrypoint=[sys.executable, "-u", "-m", "dlrover.agent.bootstrap", str(script), str(ready)],
        nproc_per_node=1,
        min_nodes=1,
        max_nodes=2,
        max_restarts=max_restarts,
        fast_restart=False,
        flash_checkpoint=False,
        hang_warning_timeout_s=0,
        monitor_interval_s=0.05,
    )
    agent = ElasticAgent(config, LocalMasterApi(job), "127.0.0.1:1", "token")
    agent.start()
    return agent


def _step_reformed_once(agent: ElasticAgent, job: JobMaster, ready: Path) -> list[object]:
    """One ``agent.step()`` in which, once the worker wrote ``ready``, a second node joins
    (the world re-forms); returns what the step returned, in a list."""
    stepped: list[object] = []
    worker = threading.Thread(target=lambda: stepped.append(agent.step()), daemon=True)
    worker.start()
    deadline = time.monotonic() + 60
    while not ready.exists():  # the worker's file is the only sign it got there
        assert time.monotonic() < deadline and worker.is_alive(), "the worker never got there"
        time.sleep(0.05)
    job.members.register_node(
        Registration("127.0.0.1", 1, "b", "worker", -1, 1)
    )  # a node joins: re-form
    job.members.join_rendezvous(JoinRequest("b", 0, 1, "127.0.0.1", 1))
    worker.join(60)
    return stepped


def test_a_user_error_raised_as_the_world_reforms_counts_toward_failing_fast(tmp_path):
    """Found by benchmarks/fault_campaign.py (seed 2, job 3): a rank raised at the step where
    another node was lost; the agent re-formed without judging it, so the error was raised
    three times before the job failed fast. Now the re-form's own failures are remembered."""
    job = JobMaster(JobMasterConfig(job_name="reform"), MemoryStateStore())
    ready, script = tmp_path / "ready", tmp_path / "train.py"
    script.write_text(RAISES_AS_IT_REFORMS)
    agent = _bootstrapped_agent(job, script, ready, max_restarts=3)
    try:
        stepped = _step_reformed_once(agent, job, ready)
        assert stepped == [None] and agent.restart_count == 0  # re-formed, no restart used
        # Raised in answer to the agent's own stop: not a root cause to report.
        assert job.diagnostics.failures() == ()
        result = agent.step()  # round 2: the same error at once
        assert result is not None and result.exit_code != 0, agent.state
        assert "same user error twice in a row (ValueError" in result.reason
        assert job.lifecycle.state is JobState.FAILED
    finally:
        agent.close()


# Round 1 raises at once, then lingers at exit (as a rank whose teardown waits on its peers):
# the error is written before the world re-forms, and the agent sees the re-form first.
RAISES_THEN_LINGERS = """
import atexit, os, sys, time
def linger():
    open(sys.argv[1], "w").close()
    while True:
        time.sleep(1)
if os.environ["DLROVER_RDZV_ROUND"] == "1":
    atexit.register(linger)
raise ValueError("bad learning rate")
"""


def test_a_user_error_raised_before_the_world_reforms_is_reported_as_its_root_cause(tmp_path):
    """Found by a CI failure of tests/e2e/test_diagnose.py: a rank raised, another node's agent
    re-formed the world on its collateral error before this agent saw the exit, and the user's
    exception never reached the master's failure table (`dlrover diagnose`)."""
    job = JobMaster(JobMasterConfig(job_name="raised"), MemoryStateStore())
    ready, script = tmp_path / "ready", tmp_path / "train.py"
    script.write_text(RAISES_THEN_LINGERS)
    # max_restarts=0: a restart would be refused; the row still says the workers restart.
    agent = _bootstrapped_agent(job, script, ready, max_restarts=0)
    try:
        stepped = _step_reformed_once(agent, job, ready)  # the error file is written first
        assert stepped == [None] and agent.state is WorkerGroupState.RESTARTING
        rows = [(f.node_id, f.failure_class.value, f.action) for f in job.diagnostics.failures()]
        assert rows == [(agent.node_id, "user_error", "restart_processes")]
        assert "ValueError: bad learning rate" in job.diagnostics.failures()[0].root_cause
    finally:
        agent.close()


# Every round raises at once, then lingers at exit: the agent sees the world re-form (another
# node's collateral error reached the master first) before it sees its worker's exit.
RAISES_THEN_LINGERS_ALWAYS = """
import atexit, os, sys, time
def linger():
    open(sys.argv[1] + os.environ["DLROVER_RDZV_ROUND"], "w").close()
    while True:
        time.sleep(1)
atexit.register(linger)
raise ValueError("bad learning rate")
"""


def test_the_same_user_error_raised_as_the_world_reforms_twice_fails_fast(tmp_path):
    """Found by benchmarks/fault_campaign.py (seed 23, job 1): a rank raised the same error on
    every attempt, but the other nodes' agents re-formed the world on their collateral errors
    before this agent saw its worker's exit, every time; it counted the error and restarted,
    and the job burned its restarts, failing late on a healthy node's collateral error. The
    second identical error fails fast, here, naming it."""
    job = JobMaster(JobMasterConfig(job_name="again"), MemoryStateStore())
    ready, script = tmp_path / "ready", tmp_path / "train.py"
    script.write_text(RAISES_THEN_LINGERS_ALWAYS)
    agent = _bootstrapped_agent(job, script, ready, max_restarts=5)
    try:
        first_round = tmp_path / "ready1"
        stepped = _step_reformed_once(agent, job, first_round)
        assert stepped == [None] and agent.state is WorkerGroupState.RESTARTING
        # Round 2: the error again, and again the world re-forms first (node b leaves).
        result: list[object] = []
        worker = threading.Thread(target=lambda: result.append(agent.step()), daemon=True)
        worker.start()
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready2").exists():
            assert time.monotonic() < deadline and worker.is_alive(), "round 2 never got there"
            time.sleep(0.05)
        job.members.lose("b", "gone")
        worker.join(60)
        (ended,) = result
        assert ended is not None and ended.exit_code != 0, agent.state  # type: ignore[attr-defined]
        assert "same user error twice in a row (ValueError" in ended.reason  # type: ignore[attr-defined]
        assert agent.state is WorkerGroupState.FAILED and agent.restart_count == 0
        assert job.lifecycle.state is JobState.FAILED
        rows = [(f.failure_class.value, f.action) for f in job.diagnostics.failures()]
        assert rows == [("user_error", "restart_processes"), ("user_error", "fail")], rows
        assert job.diagnostics.failures()[1].signature.startswith("ValueError at ")
    finally:
        agent.close()


# Optimizer steps (beats of progress, no step reports), then a clean exit.
STEPS = """
import time, torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(40):
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    time.sleep(0.05)
"""


def test_what_a_node_learned_of_its_phases_reaches_the_next_node_through_the_master(
    tmp_path: Path,
):
    """A relaunched (or replacement) node's hang timeouts start from the job's history, not
    the defaults: the agent saves its phase durations through the master as it closes, and the
    next agent takes them in as it starts."""
    job = JobMaster(JobMasterConfig(job_name="learned"), MemoryStateStore())
    script = tmp_path / "steps.py"
    script.write_text(STEPS)
    config = AgentConfig(
        entrypoint=[sys.executable, "-u", "-m", "dlrover.agent.bootstrap", str(script)],
        nproc_per_node=1,
        fast_restart=False,
        flash_checkpoint=False,
        monitor_interval_s=0.05,
    )
    first = ElasticAgent(config, LocalMasterApi(job), "127.0.0.1:1", "token")
    try:
        result = first.run()
    finally:
        first.close()
    assert result.exit_code == 0
    learned = first._hang_history
    assert learned.count("startup") == 1 and learned.count("step") >= 10
    assert 0.04 <= (learned.p99("step") or 0.0) < 1.0
    second = ElasticAgent(config, LocalMasterApi(job), "127.0.0.1:1", "token")
    second._load_hang_history()
    assert second._hang_history.count("step") == learned.count("step")
    assert second._hang_history.p99("step") == learned.p99("step")
