"""Configuration of one node's elastic agent (what dlrover-run was asked to do)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dlrover import constants as c
from dlrover.agent.workers import STD_NONE
from dlrover.hang_spec import HangSpec


@dataclass(frozen=True)
class AgentConfig:
    """Everything the agent needs; built by the CLI from torchrun-compatible flags."""

    entrypoint: list[str]
    """Full argv of a worker, e.g. [python, -u, train.py, --lr, 0.1]."""
    nproc_per_node: int
    min_nodes: int = 1
    max_nodes: int = 1
    node_unit: int = 1
    """The number of nodes in the world is always a multiple of this."""
    max_restarts: int = c.DEFAULT_MAX_RESTARTS
    """Worker-group restarts after failures allowed on this node (membership changes are free)."""
    monitor_interval_s: float = c.DEFAULT_MONITOR_INTERVAL_S
    """How often the agent checks membership changes and its workers' state."""
    membership_check_interval_s: float = c.DEFAULT_MEMBERSHIP_CHECK_INTERVAL_S
    """How often the monitor looks at what the membership watch (a long poll to the master) last
    heard: no RPC per look."""
    run_id: str = c.DEFAULT_JOB_NAME
    """TORCHELASTIC_RUN_ID: the job's name, the same on every node."""
    role: str = c.DEFAULT_ROLE
    log_dir: str = ""
    """Root of per-attempt per-rank logs: <log_dir>/<run_id>/attempt_<n>/rank_<r>/."""
    redirects: dict[int, int] = field(default_factory=dict)
    """Per local rank: which of stdout(1)/stderr(2) go to files only."""
    tee: dict[int, int] = field(default_factory=dict)
    """Per local rank: which of stdout(1)/stderr(2) go to files and the console."""
    default_redirect: int = STD_NONE
    default_tee: int = STD_NONE
    requested_node_rank: int = -1
    """--node-rank: this node's wished rank (-1: the master assigns one)."""
    store_addr: str = ""
    """--master-addr: where the rank-0 worker hosts the process-group store (default: this host)."""
    store_port: int = 0
    """--master-port: the store's port (default: a free port, fresh every round)."""
    local_addr: str = ""
    """This node's address as other nodes reach it."""
    join_timeout_s: float = c.DEFAULT_RDZV_JOIN_TIMEOUT_S
    last_call_timeout_s: float = c.DEFAULT_RDZV_LAST_CALL_TIMEOUT_S
    heartbeat_interval_s: float = c.DEFAULT_HEARTBEAT_INTERVAL_S
    stop_grace_s: float = c.DEFAULT_STOP_GRACE_S
    """After SIGTERM, how long workers get before SIGKILL."""
    master_lost_timeout_s: float = c.DEFAULT_MASTER_LOST_TIMEOUT_S
    """Heartbeats unanswered for this long: the master is gone, the node stops; 0: never."""
    exit_barrier_timeout_s: float = c.DEFAULT_EXIT_BARRIER_TIMEOUT_S
    """On success, how long to wait for the other nodes to finish too."""
    script_argv: list[str] | None = None
    """`[script, args...]` or `["-m", module, args...]` for a Python entry point (None with
    --no-python): what the bootstrap and the zygote run."""
    fast_restart: bool = True
    """Fork the workers (the first ones and restarted ones) from a zygote that has imported
    torch already; off: every worker is a fresh interpreter."""
    zygote_delay_s: float = 0.0
    """A zygote lost while workers run is started again this long into their attempt (or at
    their first reported step)."""
    zygote_wait_s: float = c.DEFAULT_ZYGOTE_WAIT_S
    """At a restart, how long to wait for a zygote still importing before starting afresh
    (a fresh start costs the imports again, so waiting longer than that gains nothing)."""
    flash_checkpoint: bool = True
    """Host the flash-checkpoint saver (shared memory that survives worker restarts)."""
    checkpoint_close_timeout_s: float = 600.0
    """At exit, how long queued checkpoint persists may take before the memory is freed."""
    node_check: bool = False
    """Check the node (compute and collective tests with the other nodes) before training."""
    exclude_straggler: bool = False
    """Leave the job when the node check finds this node a straggler (the engine replaces it)."""
    straggler_ratio: float = 2.0
    """A node slower than this multiple of the others' median check time is a straggler."""
    hang: HangSpec = field(default_factory=HangSpec)
    """Hang detection (`--hang-timeout`): per phase, learned or fixed (`dlrover.hang_spec`)."""
    exit_hang_timeout_s: float = c.DEFAULT_EXIT_HANG_TIMEOUT_S
    """A worker idle this long after its script returned, or after every other local worker
    exited successfully, is hung at exit: stacks logged, ended, counted as its script's result
    (failed when the script never returned); 0: off."""
    hang_warning_timeout_s: float = c.DEFAULT_HANG_WARNING_TIMEOUT_S
    """No progress (steps, or CPU use for scripts that report none) for this long: warn with the
    workers' stacks, once per stall, and go on; 0: off."""
    release_timeout_s: float = c.DEFAULT_RELEASE_TIMEOUT_S
    """In-process recovery: how long a surviving worker gets to leave its collective and park
    after a failure; one that does not is restarted instead."""
    compile_cache: str = ""
    """A folder every node of the job reaches (a shared filesystem): the workers' inductor and
    Triton caches live there (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR), so a replacement on
    a fresh machine compiles from the job's cache; "": torch's default (the machine's own)."""
