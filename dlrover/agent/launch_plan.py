"""What to start for one round: each worker's argv, environment and files. Pure: no I/O."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from dlrover.agent.bootstrap import ENV_DONE_FILE
from dlrover.agent.collectives import DEFAULT_FR_BUFFER, ENV_COLLECTIVES_FILE, ENV_FR_BUFFER
from dlrover.agent.compiler_warmup import compiler_in_use_marker
from dlrover.agent.config import AgentConfig
from dlrover.agent.worker_env import WorkerPlacement, worker_env
from dlrover.agent.workers import WorkerLaunch
from dlrover.api.master import CommWorld
from dlrover.constants import (
    ENV_AGENT_PID,
    ENV_CHECKPOINT_SOCKET,
    ENV_COMPILE_MARKER,
    ENV_LOCAL_INDEX,
    ENV_MAX_NODES,
    ENV_NODE_NAME,
    ENV_RECOVERY_JOIN,
    ENV_RECOVERY_SOCKET,
    ENV_STACK_FILE,
    ENV_STEP_FILE,
    ENV_VIRTUAL_RANKS,
    ENV_VIRTUAL_WORLD_SIZE,
)

CACHE_ON_MASTER = "master"
"""The ``--compile-cache`` value that keeps the job's compile caches on the master
(`dlrover.agent.compile_cache`), for nodes that share no filesystem."""


def compile_cache_env(folder: str) -> dict[str, str]:
    """The variables that put a worker's compile caches under ``folder`` (``--compile-cache``):
    inductor's (its FX graph and AOTAutograd caches too) and Triton's. Precompiled C++ headers
    are off: torch keeps them in the machine's temp folder, whatever the cache folder, and names
    them in each kernel's cache key, so with them a fresh machine missed the shared cache and
    compiled again (12.0 s instead of 3.0 s for a small transformer's first step here; without
    them 4.4 s, while a cold compile takes 58 s instead of 25 s)."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, "inductor"),
        "TRITON_CACHE_DIR": os.path.join(folder, "triton"),
        "TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0",
    }


@dataclass(frozen=True)
class WorkerFiles:
    """Where one worker leaves what the agent reads: its steps, stacks, clean finish, error."""

    step_file: str
    stack_file: str
    done_file: str
    error_file: str
    collectives_file: str = ""
    """Where it writes its collectives' summary when asked (`dlrover.agent.collectives`)."""


@dataclass(frozen=True)
class LaunchPlan:
    """The workers of one attempt on this node."""

    launches: tuple[WorkerLaunch, ...]
    files: tuple[WorkerFiles, ...]
    """Indexed by local rank."""
    rank_offset: int
    """Global rank of the node's first worker in the round."""
    active: frozenset[int]
    """Local ranks in the round: every one, but while the node goes on without failed local
    ranks (in-process recovery), those are replacements that join once ready."""

    @property
    def error_files(self) -> dict[int, str]:
        """Global rank -> its error file (a joining replacement: under its full-layout rank)."""
        return {self.launches[lr].rank: f.error_file for lr, f in enumerate(self.files)}


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
    recovery_socket: str | None = None


def plan_launch(
    config: AgentConfig,
    world: CommWorld,
    ctx: AttemptContext,
    base_env: Mapping[str, str],
    active: Collection[int] | None = None,
) -> LaunchPlan:
    """torchrun's environment for every local worker of `world`, plus DLRover's own keys.

    ``active``: the local ranks in the round (default: all). The others are replacements that
    join once they are ready (DLROVER_RECOVERY_JOIN); meanwhile the active ones stand in for
    their data (DLROVER_VIRTUAL_RANKS) and are numbered without them."""
    nproc = config.nproc_per_node
    members = sorted(active) if active is not None else list(range(nproc))
    stand_in = {lr: [lr] for lr in members}
    for i, lr in enumerate(lr for lr in range(nproc) if lr not in stand_in):
        stand_in[members[i % len(members)]].append(lr)
    full_offset = world.node_rank * nproc
    virtual_world = max(world.num_nodes, 1) * nproc
    attempt_dir = ""
    if config.log_dir:
        attempt_dir = os.path.join(config.log_dir, ctx.run_id, f"attempt_{ctx.attempt}")
    launches: list[WorkerLaunch] = []
    files: list[WorkerFiles] = []
    for local_rank in range(nproc):
        joins = local_rank not in stand_in
        if joins:  # its round comes when it is ready; until then the full layout's place
            index, rank, size, world_size = (
                local_rank,
                full_offset + local_rank,
                nproc,
                virtual_world,
            )
            virtual = [rank]
        else:
            index = members.index(local_rank)
            rank, size, world_size = world.rank_offset + index, len(members), world.world_size
            virtual = [full_offset + lr for lr in sorted(stand_in[local_rank])]
        placement = WorkerPlacement(
            local_rank=local_rank,
            local_world_size=size,
            rank=rank,
            world_size=world_size,
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
            collectives_file=os.path.join(ctx.run_dir, f"collectives.{ctx.attempt}.{local_rank}"),
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
        if config.compile_cache and config.compile_cache != CACHE_ON_MASTER:
            # The job's shared compile cache, unless the user set these variables themselves
            # (with the cache on the master the agent set them to its machine's folder).
            for name, value in compile_cache_env(config.compile_cache).items():
                env.setdefault(name, value)
        env[ENV_STEP_FILE] = wf.step_file
        env[ENV_COMPILE_MARKER] = compiler_in_use_marker(ctx.run_dir)
        env[ENV_STACK_FILE] = wf.stack_file
        env[ENV_COLLECTIVES_FILE] = wf.collectives_file
        if ENV_FR_BUFFER not in env:  # the flight recorder names the laggard of a hang
            env[ENV_FR_BUFFER] = DEFAULT_FR_BUFFER
        env[ENV_AGENT_PID] = str(ctx.agent_pid)
        env[ENV_MAX_NODES] = str(config.max_nodes)
        if ctx.saver_socket is not None:
            env[ENV_CHECKPOINT_SOCKET] = ctx.saver_socket
        if ctx.recovery_socket is not None:
            env[ENV_RECOVERY_SOCKET] = ctx.recovery_socket
            env[ENV_VIRTUAL_RANKS] = ",".join(str(r) for r in virtual)
            env[ENV_VIRTUAL_WORLD_SIZE] = str(virtual_world)
            env[ENV_LOCAL_INDEX] = str(index)
            if joins:
                env[ENV_RECOVERY_JOIN] = "1"
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
    return LaunchPlan(tuple(launches), tuple(files), world.rank_offset, frozenset(members))
