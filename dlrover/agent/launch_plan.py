"""What to start for one round: each worker's argv, environment and files. Pure: no I/O."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from dlrover.agent.bootstrap import ENV_DONE_FILE
from dlrover.agent.config import AgentConfig
from dlrover.agent.worker_env import WorkerPlacement, worker_env
from dlrover.agent.workers import WorkerLaunch
from dlrover.api.master import CommWorld
from dlrover.constants import (
    ENV_AGENT_PID,
    ENV_CHECKPOINT_SOCKET,
    ENV_MAX_NODES,
    ENV_NODE_NAME,
    ENV_STACK_FILE,
    ENV_STEP_FILE,
)


@dataclass(frozen=True)
class WorkerFiles:
    """Where one worker leaves what the agent reads: its steps, stacks, clean finish, error."""

    step_file: str
    stack_file: str
    done_file: str
    error_file: str


@dataclass(frozen=True)
class LaunchPlan:
    """The workers of one attempt on this node."""

    launches: tuple[WorkerLaunch, ...]
    files: tuple[WorkerFiles, ...]
    """Indexed by local rank."""
    rank_offset: int
    """Global rank of local rank 0."""

    @property
    def error_files(self) -> dict[int, str]:
        """Global rank -> its error file."""
        return {self.rank_offset + lr: f.error_file for lr, f in enumerate(self.files)}


@dataclass(frozen=True)
class AttemptContext:
    """What an attempt's plan depends on besides the config and the world."""

    run_id: str
    node_id: str
    restart_count: int
    attempt: int
    run_dir: str
    """The agent's private directory for step/stack/done files (and error files without
    --log-dir)."""
    master_addr: str
    token: str
    agent_pid: int
    saver_socket: str | None = None


def plan_launch(
    config: AgentConfig, world: CommWorld, ctx: AttemptContext, base_env: Mapping[str, str]
) -> LaunchPlan:
    """torchrun's environment for every local worker of `world`, plus DLRover's own keys."""
    attempt_dir = ""
    if config.log_dir:
        attempt_dir = os.path.join(config.log_dir, ctx.run_id, f"attempt_{ctx.attempt}")
    launches: list[WorkerLaunch] = []
    files: list[WorkerFiles] = []
    for local_rank in range(config.nproc_per_node):
        rank = world.rank_offset + local_rank
        placement = WorkerPlacement(
            local_rank=local_rank,
            local_world_size=config.nproc_per_node,
            rank=rank,
            world_size=world.world_size,
            node_rank=world.node_rank,
            num_nodes=world.num_nodes,
        )
        log_dir = os.path.join(attempt_dir, f"rank_{rank}") if attempt_dir else None
        private = os.path.join(ctx.run_dir, f"attempt_{ctx.attempt}", f"rank_{rank}")
        wf = WorkerFiles(
            step_file=os.path.join(ctx.run_dir, f"step.{ctx.attempt}.{local_rank}"),
            stack_file=os.path.join(ctx.run_dir, f"stacks.{ctx.attempt}.{local_rank}"),
            done_file=os.path.join(ctx.run_dir, f"done.{ctx.attempt}.{local_rank}"),
            error_file=os.path.join(log_dir or private, "error.json"),
        )
        env = worker_env(
            base_env,
            placement,
            role=config.role,
            run_id=ctx.run_id,
            restart_count=ctx.restart_count,
            max_restarts=config.max_restarts,
            store_addr=world.store_host,
            store_port=world.store_port,
            error_file=wf.error_file,
            master_addr=ctx.master_addr,
            job_token=ctx.token,
            node_id=ctx.node_id,
            rdzv_round=world.round,
        )
        env[ENV_STEP_FILE] = wf.step_file
        env[ENV_STACK_FILE] = wf.stack_file
        env[ENV_AGENT_PID] = str(ctx.agent_pid)
        env[ENV_MAX_NODES] = str(config.max_nodes)
        if ctx.saver_socket is not None:
            env[ENV_CHECKPOINT_SOCKET] = ctx.saver_socket
        env.pop(ENV_NODE_NAME, None)
        env[ENV_DONE_FILE] = wf.done_file
        files.append(wf)
        launches.append(
            WorkerLaunch(
                local_rank=local_rank,
                rank=rank,
                argv=config.entrypoint,
                env=env,
                log_dir=log_dir,
                redirect=config.redirects.get(local_rank, config.default_redirect),
                tee=config.tee.get(local_rank, config.default_tee),
                prefix=f"[{config.role}{local_rank}]:",
                script_argv=config.script_argv,
            )
        )
    return LaunchPlan(tuple(launches), tuple(files), world.rank_offset)
