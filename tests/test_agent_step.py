"""The agent stepped by hand against an in-process master (LocalMasterApi: no server, no
master process); its workers are real processes."""

from __future__ import annotations

import sys

from dlrover.agent.agent import ElasticAgent
from dlrover.agent.config import AgentConfig
from dlrover.agent.failure_policy import WorkerGroupState
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
        assert job.state is JobState.SUCCEEDED
    finally:
        agent.close()
