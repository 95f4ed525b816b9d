"""Default values and the names of every environment variable DLRover reads or sets."""

# --- Environment variables a user or launcher sets -------------------------------------------
ENV_MASTER_ADDR = "DLROVER_MASTER_ADDR"
"""host:port of the job master's gRPC service."""
ENV_JOB_TOKEN = "DLROVER_JOB_TOKEN"
"""Shared secret every RPC must carry."""

# --- Environment variables the agent sets for worker processes (besides torchrun's) ----------
ENV_NODE_ID = "DLROVER_NODE_ID"
"""The master's id for the node (agent) that started this worker."""
ENV_NODE_RANK = "DLROVER_NODE_RANK"
"""The node's rank in the current rendezvous round (same as GROUP_RANK)."""
ENV_RDZV_ROUND = "DLROVER_RDZV_ROUND"
"""The rendezvous round that formed the current world."""
ENV_CHECKPOINT_SOCKET = "DLROVER_CHECKPOINT_SOCKET"
"""Unix socket of the agent's checkpoint saver (flash checkpoint)."""
ENV_JOB_NAME = "DLROVER_JOB_NAME"
"""Name of the job (the rendezvous id)."""
ENV_MAX_NODES = "DLROVER_MAX_NODES"
"""The largest number of nodes the job may have (dlrover-run's --nnodes MAX): ElasticTrainer keeps
the global batch of that many nodes' ranks."""

# --- Defaults ---------------------------------------------------------------------------------
DEFAULT_JOB_NAME = "none"
DEFAULT_ROLE = "default"
DEFAULT_MASTER_PORT = 0
DEFAULT_MONITOR_INTERVAL_S = 0.1
DEFAULT_MEMBERSHIP_CHECK_INTERVAL_S = 0.5
DEFAULT_HEARTBEAT_INTERVAL_S = 2.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 6.0
HEARTBEATS_PER_S_BUDGET = 500.0
"""Heartbeats per second the master budgets for a whole job: with more nodes than
budget x interval, it stretches every node's interval (and the loss timeout with it)."""
SPREAD_NODES_PER_S = 1000.0
"""A large job's nodes spread the calls that one change sends them all to make at once (the
survivors' re-joins when a round breaks, the new membership watches when a round closes) over
alive nodes / this many seconds, each at a random point: 10,000 nodes take 10 s, 100 nodes
0.1 s. At once, 3,000 survivors' calls held the master's heartbeat answers for over a second."""
MAX_LONG_POLL_S = 30.0
"""The longest the master holds a long poll (rendezvous, membership watch, exit barrier); an
agent that needs to wait longer asks again."""
MAX_CHECKPOINT_WAIT_S = 10.0
"""A checkpoint wait held in the master is capped; clients ask again until their own deadline."""
DEFAULT_MAX_RESTARTS = 0
"""Worker-group restarts of a node (dlrover-run --max-restarts, a job spec's max_restarts)."""
DEFAULT_RDZV_JOIN_TIMEOUT_S = 600.0
DEFAULT_RDZV_LAST_CALL_TIMEOUT_S = 1.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
DEFAULT_RPC_TIMEOUT_S = 10.0
DEFAULT_STOP_GRACE_S = 5.0
DEFAULT_RAY_NAMESPACE = "dlrover"
"""The Ray namespace of a job's actors (engine_settings.namespace overrides it)."""
DEFAULT_EXIT_BARRIER_TIMEOUT_S = 300.0
DEFAULT_MASTER_IDLE_TIMEOUT_S = 1800.0
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
MAX_KV_VALUE_BYTES = 1024 * 1024
TOKEN_METADATA_KEY = "x-dlrover-token"
ENV_STEP_FILE = "DLROVER_STEP_FILE"
"""File where a worker's `dlrover.trainer.report_step` writes its latest step for the agent."""
DEFAULT_HANG_WARNING_TIMEOUT_S = 600.0
"""No progress for this long: the agent logs the stuck ranks with their stacks (no restart)."""
DEFAULT_EXIT_HANG_TIMEOUT_S = 60.0
"""A worker idle (no step, under 1% of a core) this long after its script returned, or after every
other local worker exited successfully, counts as hung at exit: stacks logged, ended; 0: off."""
ENV_NODE_NAME = "DLROVER_NODE_NAME"
ENV_NODE_EXIT_FILE = "DLROVER_NODE_EXIT_FILE"
"""Where dlrover-run writes its exit code as it ends (set by the local engine, which may have to
learn a node's end without being its parent: a restarted master adopting running nodes)."""
ENV_RANK_LOG_DIR = "DLROVER_RANK_LOG_DIR"
"""Set by an engine for the agent it launches: where its workers' per-rank logs go
(``<dir>/<run_id>/attempt_<n>/rank_<r>/{stdout,stderr}.log``, as with --log-dir and --redirects 3)
when the command gives no --log-dir; the engine reads them back for `dlrover logs`."""
ENV_RANK_LOG_ECHO = "DLROVER_RANK_LOG_ECHO"
"""Set (to 1) by an engine whose only readable log is the node's console (Kubernetes): the agent
also prints its workers' per-rank lines there, each as ``[rank R] line``."""
"""Set by an engine for the agent it launches: the node id the agent registers under."""
ENV_STACK_FILE = "DLROVER_STACK_FILE"
"""Set by the agent: where a worker writes its Python stacks when asked (SIGUSR1)."""
ENV_COLLECTIVES_FILE = "DLROVER_COLLECTIVES_FILE"
"""Set by the agent: where a worker writes its collectives' summary when asked (a hang;
`dlrover.agent.collectives`)."""
ENV_FR_BUFFER = "TORCH_FR_BUFFER_SIZE"
"""PyTorch's flight recorder: how many collectives it keeps (0: none recorded); the agent sets
it for its workers unless the user did."""
ENV_AGENT_PID = "DLROVER_AGENT_PID"
"""The pid of the agent that started this worker (fault injection's kill_agent uses it)."""
ENV_RECOVERY_SOCKET = "DLROVER_RECOVERY_SOCKET"
"""The agent's socket for workers that recover in-process (`dlrover.trainer.torch.inprocess`)."""
ENV_RECOVERY_JOIN = "DLROVER_RECOVERY_JOIN"
"""Set (to 1) for a replacement that joins the running workers once it is ready: its wrapped
function waits for the agent's round before it is first called."""
ENV_VIRTUAL_RANKS = "DLROVER_VIRTUAL_RANKS"
"""The ranks of the node's full layout whose data this worker trains on (comma-separated): its
own, plus those of failed local ranks while the node goes on without them."""
ENV_VIRTUAL_WORLD_SIZE = "DLROVER_VIRTUAL_WORLD_SIZE"
"""The world size of the full layout (nodes x --nproc-per-node) the virtual ranks count in."""
ENV_LOCAL_INDEX = "DLROVER_LOCAL_INDEX"
"""This worker's place among the node's workers in the round (LOCAL_RANK but for a node that
goes on without a failed local rank): which of them copies a replicated checkpoint."""

DEFAULT_RELEASE_TIMEOUT_S = 30.0
"""In-process recovery: seconds a surviving worker gets to leave its failed collective."""

DEFAULT_MASTER_RECONNECT_S = 120.0
"""How long a node keeps calling a master that does not answer (it may be restarting on its
saved state) before it gives up on a call that cannot be skipped."""

DEFAULT_MASTER_LOST_TIMEOUT_S = 600.0
"""How long a running node's heartbeats may go unanswered before it takes the job's master for
gone: it stops its workers (persisting the newest in-memory checkpoint) and exits, instead of
training on with nobody left to end the job. Long enough for a master to restart on its state."""

EXIT_MASTER_LOST = 7
"""dlrover-run's exit code when the job's master stopped answering for --master-lost-timeout."""

ENV_STRAGGLER_REPORT_S = "DLROVER_STRAGGLER_REPORT_S"
"""Seconds between runtime straggler reports of a master (default 60; tests shorten it)."""

EXIT_NODE_EXCLUDED = 5
"""dlrover-run's exit code when the node check excluded its node (its engine relaunches it)."""

EXIT_NODE_OOM = 6
"""dlrover-run's exit code when a worker was OOM-killed under the node's memory limit: the node
needs more memory, so the engine reports it OOM_KILLED and the master relaunches it bigger."""

CANNOT_START_EXIT_CODE = 127
"""A node's exit code when the user's program cannot start (no such executable, script or
module, a syntax or import error), as a shell's for a command it cannot run: the master fails
the job at once, naming the cause, instead of relaunching the node (dlrover-run, dlrover-tf-node)."""

ENV_NODE_MEMORY_LIMIT_MIB = "DLROVER_NODE_MEMORY_LIMIT_MIB"
"""Set by an engine that enforces a node's memory (the local engine's cgroup): a worker OOM-killed
under it makes the agent leave with EXIT_NODE_OOM instead of restarting in place."""

ENV_SILENT_REPLACE_S = "DLROVER_SILENT_REPLACE_S"
"""Seconds a node lost to silence (no heartbeat) may come back before the master, when an
engine runs the job, deletes it and relaunches its slot (default 10, or the job's heartbeat
timeout where that is longer)."""
DEFAULT_SILENT_REPLACE_S = 10.0

ENV_AUTOSCALE_INTERVAL_S = "DLROVER_AUTOSCALE_INTERVAL_S"
"""Seconds between the auto-scaler's plans (default 30; tests shorten it)."""
ENV_AUTOSCALE_SIZING_S = "DLROVER_AUTOSCALE_SIZING_S"
"""How long a job without resources is measured before it is sized (default 60)."""
ENV_AUTOSCALE_COOLDOWN_S = "DLROVER_AUTOSCALE_COOLDOWN_S"
"""Seconds between two auto-scaling actions (default 300)."""
ENV_AUTOSCALE_WINDOW_S = "DLROVER_AUTOSCALE_WINDOW_S"
"""The shortest span (seconds) a step rate is measured over before the auto-scaler uses it
(default 10)."""

# Embedding servers (role ``ps``) and the master, through the master's key-value store.
PS_ADDRESS_KEY = "dlrover/ps/address/"
"""+ node id: the address a `dlrover-ps` launched by the master listens on (it sets it)."""
PS_PLACEMENT_KEY = "dlrover/ps/placement"
"""The servers' current placement (an embedding_pb2.BucketMapMessage), set by the master once
they are installed and after every resize or failover; workers read it to find the servers."""
PS_SCALE_KEY = "dlrover/ps/scale"
"""JSON of the master's last ps scaling or failover (what `dlrover scale` waits for and prints):
a `dlrover.coordination.ScaleReport`."""
ENV_PS_WAIT_S = "DLROVER_PS_WAIT_S"
"""How long a worker waits for the job's embedding servers to be installed (default 300)."""

# TensorFlow parameter-server jobs (docs/tensorflow.md), through the master's key-value store.
TF_ADDRESS_KEY = "dlrover/tf/address/"
"""+ node id: the host:port a `dlrover-tf-node` will serve its role on (it sets it)."""
TF_CLUSTER_KEY = "dlrover/tf/cluster"
"""A `dlrover.coordination.TfCluster`, JSON ``{"version": N, "cluster": {role: [host:port]}}``:
the job's current cluster spec, set by the master once every node registered and again when an
address changes; the same value is kept under ``TF_CLUSTER_KEY/<N>``, so a node can wait for the
next version."""
TF_READY_KEY = "dlrover/tf/ready/"
"""+ node id: set by a ps or worker's TF server once it serves."""
TF_PS_GENERATION_KEY = "dlrover/tf/ps-generation"
"""A `dlrover.coordination.PsGeneration`, JSON ``{"generation": G, "cluster_version": N}``:
bumped by the master each time every ps of the current cluster serves again (1: the first time;
+1 after each ps relaunch); also kept under ``TF_PS_GENERATION_KEY/<G>``. The chief waits for
the next generation after losing a ps."""
ENV_TF_CLUSTER_VERSION = "DLROVER_TF_CLUSTER_VERSION"
"""Set by `dlrover-tf-node`: the version of the cluster spec in TF_CONFIG."""
TF_START_ERROR_KEY = "dlrover/tf/start-error/"
"""+ node id: why a TensorFlow node's program could not start (then it exits 127)."""

TF_USAGE_KEY = "dlrover/tf/usage/"
"""+ node id: a `dlrover.coordination.TfNodeUsage`, the node's CPU and memory as it measured
them, set every `ENV_TF_USAGE_INTERVAL_S` by the node."""
TF_PROGRESS_KEY = "dlrover/tf/progress"
"""A `dlrover.coordination.TfProgress`: the chief's batches and samples finished, set by its
`PsTrainer` each time its scheduled batches finished."""
ENV_ZYGOTE_NICE = "DLROVER_ZYGOTE_NICE"
"""The nice value (0-19, default 0) of the zygote's imports. The first workers fork from the
zygote, so its imports are on the first start's path; 19 makes them take only idle CPU (a zygote
started again after it was lost, while workers run), and on a saturated node can starve them."""
DEFAULT_ZYGOTE_NICE = 0
ENV_ZYGOTE_WAIT_S = "DLROVER_ZYGOTE_WAIT_S"
"""Seconds a restart waits for a zygote still importing before it starts its workers afresh
(default 3; the zygote then serves later restarts)."""
DEFAULT_ZYGOTE_WAIT_S = 3.0
DEFAULT_ZYGOTE_FIRST_WAIT_S = 30.0
ENV_COMPILE_MARKER = "DLROVER_COMPILE_MARKER"
"""Set by the agent for its workers: the file a worker forked by the zygote creates as its script
imports inductor's compiler (`dlrover.agent.compiler_warmup`)."""
ENV_ZYGOTE_WARM_COMPILER = "DLROVER_ZYGOTE_WARM_COMPILER"
"""1 (default): once the node's workers compile, the zygote imports inductor's compiler and asks
its machine probes, so that restarted workers skip that work; 0: never."""
"""Seconds the first start waits for the zygote begun as the agent started (importing at normal
priority, so a fresh start would cost as much) before its workers start afresh."""
ENV_TF_USAGE_INTERVAL_S = "DLROVER_TF_USAGE_INTERVAL_S"
"""Seconds between two usage reports of a TensorFlow node (default 2; 0: none)."""
DEFAULT_TF_USAGE_INTERVAL_S = 2.0

# --- Job spec defaults (dlrover/jobspec.py; `dlrover submit` flags default to them too) --------
DEFAULT_NPROC_PER_NODE = 1
"""Worker processes each node's agent starts."""
DEFAULT_MAX_RELAUNCHES = 3
"""Replacements of one node slot before the job fails."""
DEFAULT_OOM_MEMORY_FACTOR = 1.5
"""After an OOM kill a node is relaunched with this times its memory."""
DEFAULT_OOM_MAX_MEMORY_MIB = 256 * 1024
"""The cap of that growth, in MiB (256 GiB)."""
DEFAULT_PS_REPLICA = "async"
"""How an embedding server keeps its rows on the next one (async, sync, none)."""
DEFAULT_SUBMIT_MAX_RESTARTS = 3
"""`dlrover submit --max-restarts` when not given (a YAML spec without max_restarts gets
DEFAULT_MAX_RESTARTS, as dlrover-run does)."""

# === Environment variables of each subsystem (their one place; the subsystem's module re-exports
# the name and reads it) ======================================================================

# --- flash checkpoint (read by dlrover.checkpoint.config) ---
ENV_CKPT_BUFFERS = "DLROVER_CKPT_BUFFERS"
"""Shared-memory buffers per saving rank: 2 (default; a save never waits for the persist or
push of the previous step) or 1 (half the memory; a save waits for them)."""
ENV_CKPT_PERSIST_PRIORITY = "DLROVER_CKPT_PERSIST_PRIORITY"
"""CPU priority of the agent's persist and replica threads: ``batch`` (default: SCHED_BATCH
at nice 0), ``batch:<n>`` (SCHED_BATCH at niceness n, 0..19), ``idle`` (SCHED_IDLE: only CPU
time nobody else wants), or ``nice:<n>`` (SCHED_OTHER at niceness n). docs/checkpoint.md has
the measurements behind the default."""
ENV_CKPT_REPLICA_MIB_S = "DLROVER_CKPT_REPLICA_MIB_S"
"""Cap on the rate an agent pushes checkpoint replicas to its peers, in MiB/s (0: no cap)."""
ENV_CKPT_SHM_DIR = "DLROVER_CKPT_SHM_DIR"
"""The tmpfs folder the saver keeps its buffers in (default /dev/shm)."""
ENV_CKPT_SPILL_DIR = "DLROVER_CKPT_SPILL_DIR"
"""Where a saver puts a slot's buffers when the shared-memory folder has no room for them: a
folder on local disk (default: the temp folder), or ``off`` (the save raises ShmSpaceError)."""

# --- data sharding (read by dlrover.sharding.config) ---
ENV_SHARD_PREFETCH = "DLROVER_SHARD_PREFETCH"
"""Overrides DEFAULT_PREFETCH_SHARDS for the client built by the elastic sampler."""
ENV_SHARD_LEASE_S = "DLROVER_SHARD_LEASE_S"
"""Overrides DEFAULT_LEASE_S for datasets registered by the elastic sampler."""
ENV_DELIVERY_MODE = "DLROVER_DELIVERY_MODE"
"""The delivery mode of the datasets and streams a job's workers register when their code does
not name one (``at-least-once``, ``exactly-once`` or ``at-most-once``); a job spec's
``delivery_mode`` sets it."""

# --- the elastic trainer ---
ENV_WORKER_NUM = "WORKER_NUM"
"""DLRover's name for the largest number of worker nodes a job may have; read when set."""

# --- the elastic data loader ---
ENV_PARALLELISM_CONFIG = "DLROVER_PARAL_CONFIG_PATH"
"""A JSON file whose ``{"dataloader": {"batch_size": N, "version": V}}`` sets the batch size
(DLRover's parallelism config); a higher ``version`` than the last one read applies."""

# --- ElasticEmbedding ---
ENV_PS_ADDRS = "DLROVER_PS_ADDRS"
"""Comma-separated addresses of the job's embedding servers, server 0 first."""

# --- TensorFlow parameter-server training ---
ENV_TF_RESCALE = "_DLROVER_TF_RESCALE"
"""Set for the chief's next process when it starts again over more ps: when and what."""

ENV_TF_PS_SCALED = "_DLROVER_TF_PS_SCALED"
"""Set (internal) on a chief started again because the job's ps count changed: its tables are
split finer from then on, so that a hot range of rows spreads over every ps."""

# --- a worker's bootstrap (set by the agent) ---
ENV_PARENT_DEATH_PID = "DLROVER_PARENT_DEATH_PID"
"""Set by the spawner: the worker kills itself when this process (its parent) dies."""
ENV_DONE_FILE = "DLROVER_DONE_FILE"
"""Set by the agent: the bootstrap writes the script's exit code to this file once the script has
returned (or raised), before interpreter shutdown begins (see `read_script_result`)."""

# --- dlrover-ps ---
ENV_PS_ADDR = "DLROVER_PS_ADDR"
"""What ``--write-env`` writes: the address the server listens on."""

# --- dlrover submit's supervisor and its child ---
ENV_SUPERVISED_METRICS_PORT = "DLROVER_SUPERVISED_METRICS_PORT"
"""The metrics port a supervised `dlrover submit` child serves on (picked by its supervisor)."""
ENV_SUPERVISED = "_DLROVER_SUPERVISED_MASTER"
"""Set by `supervise_job` for its child: ``<port>:<state path>`` (the child serves the job on
them; a restarted child resumes from the state)."""

# --- fault injection (dlrover.faults) ---
ENV_THROTTLE = "DLROVER_THROTTLE"
"""How the ``slow`` fault throttles a worker: ``quota`` (cgroup CPU quota) or ``stop`` (a
SIGSTOP/SIGCONT cycle) forces that way, for tests of the fallback; empty: quota where possible."""
ENV_FAULTS = "DLROVER_FAULTS"
"""The faults to inject (syntax: `dlrover.faults`)."""

# --- where DLRover keeps things, how it logs ---
ENV_HOME = "DLROVER_HOME"
"""Where `dlrover submit` keeps job records, states and local nodes' logs (default ~/.dlrover)."""
ENV_LOG_LEVEL = "DLROVER_LOG_LEVEL"
"""Log level of DLRover's commands (default INFO)."""
