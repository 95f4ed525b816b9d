"""The worker environment contract (pure function)."""

import pytest

from dlrover.agent.worker_env import WorkerPlacement, worker_env
from dlrover.worker_context import WorkerContext


def _sample_env(base: dict[str, str]) -> dict[str, str]:
    """Rank 3 of 4: local rank 1 of node 1 of 2, restart 2, round 3."""
    return worker_env(
        base,
        WorkerPlacement(
            local_rank=1, local_world_size=2, rank=3, world_size=4, node_rank=1, num_nodes=2
        ),
        role="trainer",
        run_id="job",
        restart_count=2,
        max_restarts=5,
        store_addr="h0",
        store_port=1234,
        error_file="/tmp/e.json",
        master_addr="m:1",
        job_token="t",
        node_id="n1",
        rdzv_round=3,
    )


def test_worker_env_has_torchrun_keys_and_dlrover_keys():
    env = _sample_env({"PATH": "/bin"})
    assert env["PATH"] == "/bin"
    assert {
        k: env[k]
        for k in (
            "LOCAL_RANK",
            "RANK",
            "GROUP_RANK",
            "ROLE_RANK",
            "ROLE_NAME",
            "LOCAL_WORLD_SIZE",
            "WORLD_SIZE",
            "GROUP_WORLD_SIZE",
            "ROLE_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_MAX_RESTARTS",
            "TORCHELASTIC_RUN_ID",
            "TORCHELASTIC_ERROR_FILE",
            "OMP_NUM_THREADS",
        )
    } == {
        "LOCAL_RANK": "1",
        "RANK": "3",
        "GROUP_RANK": "1",
        "ROLE_RANK": "3",
        "ROLE_NAME": "trainer",
        "LOCAL_WORLD_SIZE": "2",
        "WORLD_SIZE": "4",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_WORLD_SIZE": "4",
        "MASTER_ADDR": "h0",
        "MASTER_PORT": "1234",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "5",
        "TORCHELASTIC_RUN_ID": "job",
        "TORCHELASTIC_ERROR_FILE": "/tmp/e.json",
        "OMP_NUM_THREADS": "1",
    }
    assert env["DLROVER_MASTER_ADDR"] == "m:1" and env["DLROVER_JOB_TOKEN"] == "t"


def test_user_omp_num_threads_is_kept():
    env = worker_env(
        {"OMP_NUM_THREADS": "4"},
        WorkerPlacement(0, 2, 0, 2, 0, 1),
        role="r",
        run_id="j",
        restart_count=0,
        max_restarts=0,
        store_addr="h",
        store_port=1,
        error_file="",
        master_addr="m:1",
        job_token="",
        node_id="n",
        rdzv_round=1,
    )
    assert env["OMP_NUM_THREADS"] == "4"


def test_what_the_agent_writes_the_worker_reads_back():
    env = _sample_env({})
    assert WorkerContext.from_env(env) == WorkerContext(
        rank=3,
        local_rank=1,
        world_size=4,
        local_world_size=2,
        node_rank=1,
        restart_count=2,
        rdzv_round=3,
        node_id="n1",
        run_id="job",
    )
    assert WorkerContext.from_env({}) == WorkerContext()  # plain `python train.py`
    with pytest.raises(ValueError, match=r"\$RANK='x'"):
        WorkerContext.from_env({"RANK": "x"})


def test_nodes_of_one_round_agree_on_the_checkpoint_round_whatever_their_restart_counts() -> None:
    """One node restarted its workers after a failure (restart 1), the other only re-formed
    (restart 0): both load in rendezvous round 4 and must vote in the same checkpoint round,
    or each waits 60 s for the other's vote."""
    from dlrover.checkpoint.engine import WorkerPlacement as CheckpointPlacement

    def env(restart_count: int, node_rank: int) -> dict[str, str]:
        return worker_env(
            {},
            WorkerPlacement(0, 1, node_rank, 2, node_rank, 2),
            role="r", run_id="j", restart_count=restart_count, max_restarts=3,
            store_addr="h", store_port=1, error_file="", master_addr="m:1", job_token="",
            node_id=f"n{node_rank}", rdzv_round=4,
        )  # fmt: skip

    import os
    from unittest import mock

    ids = set()
    for restarts, node in ((1, 0), (0, 1)):
        with mock.patch.dict(os.environ, env(restarts, node), clear=True):
            ids.add(CheckpointPlacement.from_env().round_id)
    assert ids == {4}
