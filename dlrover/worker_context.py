"""The worker environment, read side: every variable a worker process gets from its agent,
named once and parsed once. `dlrover.agent.worker_env` writes the same names.

torchrun's contract (RANK, LOCAL_RANK, WORLD_SIZE, ...) plus DLRover's own keys; a process
started without an agent (plain `python train.py`) reads the defaults of a one-process job.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from dlrover import constants as c

RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
"""The node rank."""
GROUP_WORLD_SIZE = "GROUP_WORLD_SIZE"
"""The number of nodes."""
ROLE_RANK = "ROLE_RANK"
ROLE_NAME = "ROLE_NAME"
ROLE_WORLD_SIZE = "ROLE_WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
"""Where the rank-0 worker hosts the process-group store (not the DLRover master)."""
MASTER_PORT = "MASTER_PORT"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS = "TORCHELASTIC_MAX_RESTARTS"
RUN_ID = "TORCHELASTIC_RUN_ID"
USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name, "")
    try:
        return int(text) if text else default
    except ValueError:
        raise ValueError(f"${name}={text!r} is not an integer") from None


@dataclass(frozen=True)
class WorkerContext:
    """Where this process sits in the job, as its agent described it in the environment."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    restart_count: int = 0
    rdzv_round: int = 0
    node_id: str = ""
    run_id: str = ""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerContext:
        """Parse the environment (default: this process's); a malformed number is a
        ValueError naming the variable."""
        env = os.environ if env is None else env
        rank = _int(env, RANK, 0)
        return cls(
            rank=rank,
            local_rank=_int(env, LOCAL_RANK, rank),
            world_size=_int(env, WORLD_SIZE, 1),
            local_world_size=_int(env, LOCAL_WORLD_SIZE, 1),
            node_rank=_int(env, GROUP_RANK, _int(env, c.ENV_NODE_RANK, 0)),
            restart_count=_int(env, RESTART_COUNT, 0),
            rdzv_round=_int(env, c.ENV_RDZV_ROUND, 0),
            node_id=env.get(c.ENV_NODE_ID, ""),
            run_id=env.get(RUN_ID, ""),
        )
