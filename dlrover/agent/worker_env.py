"""The environment every worker gets: exactly torchrun's contract, plus DLRover's own keys.

The names are those of `dlrover.worker_context`, which reads them back in the worker."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dlrover import constants as c
from dlrover import worker_context as w


@dataclass(frozen=True)
class WorkerPlacement:
    """Where one worker sits in the world formed by a rendezvous round."""

    local_rank: int
    local_world_size: int
    rank: int
    world_size: int
    node_rank: int
    num_nodes: int


def worker_env(
    base: Mapping[str, str],
    placement: WorkerPlacement,
    *,
    role: str,
    run_id: str,
    restart_count: int,
    max_restarts: int,
    store_addr: str,
    store_port: int,
    error_file: str,
    master_addr: str,
    job_token: str,
    node_id: str,
    rdzv_round: int,
) -> dict[str, str]:
    """The full environment of a worker process (a pure function of its inputs)."""
    env = dict(base)
    env.update(
        {
            w.LOCAL_RANK: str(placement.local_rank),
            w.RANK: str(placement.rank),
            w.GROUP_RANK: str(placement.node_rank),
            w.ROLE_RANK: str(placement.rank),
            w.ROLE_NAME: role,
            w.LOCAL_WORLD_SIZE: str(placement.local_world_size),
            w.WORLD_SIZE: str(placement.world_size),
            w.GROUP_WORLD_SIZE: str(placement.num_nodes),
            w.ROLE_WORLD_SIZE: str(placement.world_size),
            w.MASTER_ADDR: store_addr,
            w.MASTER_PORT: str(store_port),
            w.RESTART_COUNT: str(restart_count),
            w.MAX_RESTARTS: str(max_restarts),
            w.RUN_ID: run_id,
            # The rank-0 worker hosts a fresh store every round, so no stale keys of an earlier
            # attempt can be read by restarted workers (the agent never shares a store).
            w.USE_AGENT_STORE: "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            w.ERROR_FILE: error_file,
            c.ENV_MASTER_ADDR: master_addr,
            c.ENV_JOB_TOKEN: job_token,
            c.ENV_NODE_ID: node_id,
            c.ENV_NODE_RANK: str(placement.node_rank),
            c.ENV_RDZV_ROUND: str(rdzv_round),
            c.ENV_JOB_NAME: run_id,
        }
    )
    if "OMP_NUM_THREADS" not in base and placement.local_world_size > 1:
        # torchrun's default: one thread per worker so N workers do not oversubscribe the cores.
        env["OMP_NUM_THREADS"] = "1"
    return env
