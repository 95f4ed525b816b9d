"""The job spec: what a user submits (YAML or flags), validated once, turned into NodeSpecs."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from dlrover.constants import (
    DEFAULT_MAX_RELAUNCHES,
    DEFAULT_MAX_RESTARTS,
    DEFAULT_NPROC_PER_NODE,
    DEFAULT_OOM_MAX_MEMORY_MIB,
    DEFAULT_OOM_MEMORY_FACTOR,
    DEFAULT_PS_REPLICA,
    ENV_DELIVERY_MODE,
    ENV_JOB_NAME,
    ENV_JOB_TOKEN,
    ENV_MASTER_ADDR,
)
from dlrover.elasticjob import ElasticJobError, is_elasticjob, spec_of
from dlrover.engines import sizes
from dlrover.engines.base import Capacity, InvalidNodeSpecError, NodeSpec, Resources
from dlrover.engines.registry import BUILTIN_ENGINES, LOCAL, EngineRegistry, node_host
from dlrover.hang_spec import HangSpec, HangSpecError
from dlrover.sharding.types import DeliveryMode

ENGINES = BUILTIN_ENGINES.names
"""Engine names a job spec may ask for (those of `BUILTIN_ENGINES`)."""
DEFAULT_ENGINE = LOCAL.name
DEFAULT_AGENT_COMMAND = ("dlrover-run",)
"""argv prefix that starts a node's agent; the engine runs it on every node."""
PS_COMMAND = ("dlrover-ps",)
"""argv prefix that starts an embedding server (a node of role ``ps``)."""
PS_REPLICAS = ("async", "sync", "none")
"""How an embedding server keeps its rows on the next one (docs/embedding.md)."""
TF_STRATEGIES = ("ParameterServerStrategy",)
"""``distribution_strategy`` values: TensorFlow jobs made of chief, ps, worker, evaluator."""
TF_ROLES = ("chief", "ps", "worker", "evaluator")
"""The roles of a TensorFlow parameter-server job (docs/tensorflow.md)."""
TF_NODE_COMMAND = ("dlrover-tf-node",)
"""argv prefix that starts a node of a TensorFlow job: it registers its address with the master,
waits for the cluster spec, sets TF_CONFIG and runs the role's program."""

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


class JobSpecError(ValueError):
    """The job spec is invalid; the message names the field and what to do."""


@dataclasses.dataclass(frozen=True)
class PsSpec:
    """The job's embedding servers (``roles: {ps: ...}``): how many, their size, and how each
    keeps a replica of its rows on the next one."""

    count: int
    """Servers at the start; `dlrover scale NAME --role ps --count N` changes it."""
    resources: Resources = dataclasses.field(default_factory=Resources)
    replica: str = DEFAULT_PS_REPLICA
    """One of PS_REPLICAS: ``sync`` loses nothing on a failover, ``async`` (default) the last
    ~50 ms of updates, ``none`` cannot fail over."""
    max_count: int = 0
    """With ``auto_scale`` and a memory size: servers are added up to this many as they fill
    (0: ``count``, no growth)."""


@dataclasses.dataclass(frozen=True)
class RoleSpec:
    """One role of a TensorFlow job: how many nodes, and what each asks for."""

    count: int
    resources: Resources = dataclasses.field(default_factory=Resources)
    max_count: int = 0
    """With ``auto_scale``: the most nodes the master runs (0: ``count``, no growth): workers
    added from measured throughput, ps added for a hot or saturated ps; ``count`` is where the
    job starts and the least it keeps."""


@dataclasses.dataclass(frozen=True)
class TfSpec:
    """A TensorFlow parameter-server job (``distribution_strategy: ParameterServerStrategy``):
    its roles. Invariant: exactly one chief (it runs the entrypoint), at least one ps and one
    worker, at most one evaluator."""

    strategy: str
    roles: Mapping[str, RoleSpec] = dataclasses.field(default_factory=dict)
    """Role -> its nodes; a role that is absent has none."""

    def count(self, role: str) -> int:
        """Nodes of ``role`` at the start (0 for a role the job does not have)."""
        spec = self.roles.get(role)
        return spec.count if spec is not None else 0


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """One job as the user describes it. Built by `load_job_spec` / `job_spec_from_dict`, which
    validate, so an instance is always runnable."""

    name: str
    """Job name: 1-40 lowercase letters, digits or '-' (it names pods and actors)."""
    entrypoint: str
    """Training script (or module with `-m`) each worker runs."""
    args: tuple[str, ...] = ()
    """Arguments passed to the entrypoint."""
    min_nodes: int = 1
    max_nodes: int = 1
    """Elastic range: the job runs with any node count in [min_nodes, max_nodes]."""
    nproc_per_node: int = DEFAULT_NPROC_PER_NODE
    """Worker processes each agent starts."""
    resources: Resources = dataclasses.field(default_factory=Resources)
    """What each node asks for (cpu, memory, gpu, /dev/shm)."""
    max_restarts: int = DEFAULT_MAX_RESTARTS
    """In-place restarts of a node's workers before the node counts as failed."""
    max_relaunches: int = DEFAULT_MAX_RELAUNCHES
    """Replacements of one node slot before the job fails."""
    oom_memory_factor: float = DEFAULT_OOM_MEMORY_FACTOR
    """After an OOM kill a node is relaunched with this times its memory (> 1)."""
    oom_max_memory_mib: int = DEFAULT_OOM_MAX_MEMORY_MIB
    """The cap of that growth, in MiB (spec key ``oom_max_memory``, e.g. ``64Gi``)."""
    checkpoint_dir: str = ""
    """Where flash checkpoints are persisted ("" = no persistence)."""
    engine: str = DEFAULT_ENGINE
    """One of ENGINES."""
    engine_settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Engine-specific settings (ray: address; kubernetes: namespace, image, ...)."""
    node_check: bool = False
    """Check every node before training (`dlrover-run --node-check`)."""
    auto_scale: bool = False
    """Let the master size the nodes (and, as it lands, scale them): dlrover/master/autoscaler.py."""
    exclude_straggler: bool = False
    """Replace stragglers: those the node check finds (`dlrover-run --exclude-straggler`) and
    nodes that stay slow while training (runtime scores, dlrover/master/stragglers.py)."""
    hang_timeout: str = "auto"
    """Hang detection, as the agent's ``--hang-timeout`` takes it (`dlrover.hang_spec`): ``auto``
    (learned per phase, the default), ``off``, seconds for every phase, or per phase."""
    compile_cache: str = ""
    """A folder every node reaches (a shared filesystem) for the workers' compile caches, or
    ``master`` (the master keeps the job's copy; each node fetches it as it starts): each
    agent's ``--compile-cache``. A replacement on a fresh machine compiles from it."""
    delivery_mode: str = ""
    """How the datasets and streams the workers read deliver data when their code names no
    mode: ``at-least-once``, ``exactly-once`` or ``at-most-once`` (DLROVER_DELIVERY_MODE in the
    workers' environment); "" leaves each reader's own default."""
    spares: int = 0
    """Hot spare nodes launched beyond max nodes: each registers, warms its zygote and waits;
    a lost node's place is taken by a spare in the next round, without a launch, and the engine
    replaces the lost node in the background (the replacement waits as the next spare)."""
    ps: PsSpec | None = None
    """Embedding servers (role ``ps``), or None for a job of workers only."""
    tf: TfSpec | None = None
    """A TensorFlow parameter-server job's roles, or None for an all-reduce (dlrover-run) job."""

    @property
    def hang_timeout_s(self) -> float:
        """The seconds of a plain ``hang_timeout`` (every phase fixed); 0 otherwise."""
        return HangSpec.parse(self.hang_timeout).every or 0.0

    @property
    def nnodes(self) -> str:
        """``MIN:MAX``, as the agent's --nnodes takes it."""
        return f"{self.min_nodes}:{self.max_nodes}"

    def agent_command(self) -> tuple[str, ...]:
        """argv every node runs: the agent with torchrun-style flags, then the entrypoint."""
        return (
            *DEFAULT_AGENT_COMMAND,
            f"--nnodes={self.nnodes}",
            f"--rdzv-id={self.name}",
            f"--nproc-per-node={self.nproc_per_node}",
            f"--max-restarts={self.max_restarts}",
            *(["--node-check"] if self.node_check else []),
            *(["--exclude-straggler"] if self.node_check and self.exclude_straggler else []),
            *([f"--hang-timeout={self.hang_timeout}"] if self.hang_timeout != "auto" else []),
            *([f"--compile-cache={self.compile_cache}"] if self.compile_cache else []),
            *self.program(),
        )

    def program(self) -> tuple[str, ...]:
        """What dlrover-run runs: the entrypoint and its arguments; ``python -m MODULE ARGS``
        as its ``--module MODULE ARGS``."""
        python = os.path.basename(self.entrypoint) in PYTHONS
        if python and len(self.args) > 1 and self.args[0] == "-m":
            return ("--module", *self.args[1:])
        return (self.entrypoint, *self.args)

    def _node_env(self, master_addr: str, token: str, data: bool = True) -> dict[str, str]:
        """What every node's process finds in its environment: the master, the token, the job;
        for nodes whose workers read data (``data``), the delivery mode the job spec names."""
        env = {ENV_MASTER_ADDR: master_addr, ENV_JOB_TOKEN: token, ENV_JOB_NAME: self.name}
        if data and self.delivery_mode:
            env[ENV_DELIVERY_MODE] = self.delivery_mode
        return env

    def node_spec(
        self, rank: int, master_addr: str, token: str, relaunch_count: int = 0, role: str = "worker"
    ) -> NodeSpec:
        """The blueprint of node `rank`, pointing its agent at the master."""
        env = self._node_env(master_addr, token)
        return NodeSpec(
            job_name=self.name,
            role=role,
            rank=rank,
            relaunch_count=relaunch_count,
            command=self.agent_command(),
            env=env,
            resources=self.resources,
        )

    def ps_node_spec(
        self, rank: int, master_addr: str, token: str, relaunch_count: int = 0
    ) -> NodeSpec:
        """The blueprint of embedding server ``rank``: a `dlrover-ps` that registers its address
        with the master (loopback on the local engine, every interface elsewhere)."""
        if self.ps is None:
            raise JobSpecError(f"job {self.name} has no ps role")
        host = node_host(self.engine)
        env = self._node_env(master_addr, token, data=False)
        return NodeSpec(
            job_name=self.name,
            role="ps",
            rank=rank,
            relaunch_count=relaunch_count,
            command=(*PS_COMMAND, "--host", host, "--port", "0"),
            env=env,
            resources=self.ps.resources,
        )

    def tf_node_spec(
        self,
        role: str,
        rank: int,
        master_addr: str,
        token: str,
        relaunch_count: int = 0,
    ) -> NodeSpec:
        """The blueprint of node ``rank`` of ``role`` in a TensorFlow job: `dlrover-tf-node`,
        which registers its address, waits for the cluster spec and runs a TF server (ps,
        worker) or the entrypoint (chief, evaluator) with TF_CONFIG set."""
        if self.tf is None or role not in self.tf.roles:
            raise JobSpecError(f"job {self.name} has no TensorFlow role {role!r}")
        host = node_host(self.engine)
        env = self._node_env(master_addr, token)
        program = ("--", self.entrypoint, *self.args) if role in ("chief", "evaluator") else ()
        return NodeSpec(
            job_name=self.name,
            role=role,
            rank=rank,
            relaunch_count=relaunch_count,
            command=(*TF_NODE_COMMAND, "--role", role, "--index", str(rank), "--host", host)
            + program,
            env=env,
            resources=self.tf.roles[role].resources,
        )


def parse_nnodes(value: str | int) -> tuple[int, int]:
    """'2:4' -> (2, 4); '3' or 3 -> (3, 3)."""
    text = str(value).strip()
    parts = text.split(":")
    try:
        if len(parts) == 1:
            low = high = int(parts[0])
        elif len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
        else:
            raise ValueError(text)
    except ValueError:
        raise JobSpecError(
            f"nodes {text!r} must be N or MIN:MAX with integers, e.g. nodes: 2:4"
        ) from None
    if low < 1:
        raise JobSpecError(f"nodes {text!r}: MIN must be >= 1")
    if low > high:
        raise JobSpecError(
            f"nodes {text!r}: MIN ({low}) is greater than MAX ({high}); "
            f"write {high}:{low} or a single number"
        )
    return low, high


def parse_memory_mib(value: str | int | float, field: str = "memory") -> int:
    """'4Gi' -> 4096, '512Mi' -> 512, 2048 (a number is MiB) -> 2048. Refuses negatives."""
    try:
        return sizes.parse_memory_mib(value, field)
    except sizes.SizeError as error:
        raise JobSpecError(str(error)) from None


def _number(section: Mapping[str, Any], key: str, where: str) -> float:
    value = section.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise JobSpecError(f"{where}.{key} must be a number, not {value!r}")
    if value < 0:
        raise JobSpecError(f"{where}.{key} is {value}; it must be >= 0")
    return float(value)


def _resources(raw: Any) -> Resources:
    if raw is None:
        return Resources()
    if not isinstance(raw, Mapping):
        raise JobSpecError(f"resources must be a mapping (cpu, memory, gpu, shm), not {raw!r}")
    unknown = set(raw) - {"cpu", "memory", "gpu", "shm"}
    if unknown:
        raise JobSpecError(
            f"resources has unknown keys {sorted(unknown)}; allowed: cpu, memory, gpu, shm"
        )
    cpu = _number(raw, "cpu", "resources")
    gpu = _number(raw, "gpu", "resources")
    if gpu != int(gpu):
        raise JobSpecError(f"resources.gpu is {gpu}; it must be a whole number")
    try:
        return Resources(
            cpu=cpu,
            memory_mib=parse_memory_mib(raw.get("memory", 0)),
            gpu=int(gpu),
            shm_mib=parse_memory_mib(raw.get("shm", 0), "shm"),
        )
    except InvalidNodeSpecError as error:
        raise JobSpecError(str(error)) from None


def _roles(raw: Any, strategy: str) -> PsSpec | TfSpec | None:
    """``roles:`` -- without ``distribution_strategy`` the ``ps`` role (embedding servers of a
    PyTorch job; workers are the top level); with ``distribution_strategy:
    ParameterServerStrategy`` the TensorFlow roles chief, ps, worker, evaluator."""
    if strategy:
        return _tf_roles(raw, strategy)
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise JobSpecError(f"roles must be a mapping of role -> settings, not {raw!r}")
    for role in raw:
        if role in ("chief", "evaluator", "worker"):
            raise JobSpecError(
                f"roles.{role} is a role of TensorFlow parameter-server jobs: add "
                "distribution_strategy: ParameterServerStrategy (docs/tensorflow.md); without "
                "it roles takes only ps, the embedding servers of a PyTorch job "
                "(docs/embedding.md)"
            )
        if role != "ps":
            raise JobSpecError(
                f"roles.{role}: unknown role; roles takes ps (workers are the top level: nodes, "
                "resources)"
            )
    ps = raw.get("ps")
    if ps is None:
        return None
    if not isinstance(ps, Mapping):
        raise JobSpecError("roles.ps must be a mapping: count, resources, replica")
    unknown = set(ps) - {"count", "resources", "replica", "max_count"}
    if unknown:
        raise JobSpecError(
            f"roles.ps has unknown keys {sorted(unknown)}; allowed: count, resources, replica, "
            "max_count"
        )
    count = _count(ps, "ps", 1, 1)
    most = ps.get("max_count", count)
    if isinstance(most, bool) or not isinstance(most, int) or most < count:
        raise JobSpecError(f"roles.ps.max_count is {most!r}; it must be an integer >= count")
    replica = str(ps.get("replica", DEFAULT_PS_REPLICA)).lower()
    if replica not in PS_REPLICAS:
        raise JobSpecError(
            f"roles.ps.replica is {ps.get('replica')!r}; choose one of {', '.join(PS_REPLICAS)}"
        )
    return PsSpec(count, _role_resources(ps, "ps"), replica, most)


def _count(section: Mapping[str, Any], role: str, default: int, low: int) -> int:
    count = section.get("count", default)
    if isinstance(count, bool) or not isinstance(count, int) or count < low:
        raise JobSpecError(f"roles.{role}.count is {count!r}; it must be an integer >= {low}")
    return count


def _role_resources(section: Mapping[str, Any], role: str) -> Resources:
    try:
        return _resources(section.get("resources"))
    except JobSpecError as error:
        raise JobSpecError(f"roles.{role}.{error}") from None


def _tf_roles(raw: Any, strategy: str) -> TfSpec:
    if strategy not in TF_STRATEGIES:
        raise JobSpecError(
            f"distribution_strategy {strategy!r} is not supported; choose "
            f"{' or '.join(TF_STRATEGIES)} (or leave it out for a PyTorch job)"
        )
    if not isinstance(raw, Mapping):
        raise JobSpecError(
            f"distribution_strategy {strategy} needs roles: ps and worker (count, resources), "
            "e.g. roles: {ps: {count: 2}, worker: {count: 2}}"
        )
    roles: dict[str, RoleSpec] = {}
    for role, section in raw.items():
        if role not in TF_ROLES:
            raise JobSpecError(f"roles.{role}: unknown role; choose from {', '.join(TF_ROLES)}")
        if section is None:
            section = {}
        if not isinstance(section, Mapping):
            raise JobSpecError(f"roles.{role} must be a mapping: count, resources")
        scaled = role in ("ps", "worker")
        allowed = {"count", "resources", "max_count"} if scaled else {"count", "resources"}
        unknown = set(section) - allowed
        if unknown:
            raise JobSpecError(
                f"roles.{role} has unknown keys {sorted(unknown)}; allowed: "
                f"{', '.join(sorted(allowed))}"
            )
        count = _count(section, role, 1, 0)
        most = section.get("max_count", count)
        if isinstance(most, bool) or not isinstance(most, int) or most < count:
            raise JobSpecError(
                f"roles.{role}.max_count is {most!r}; it must be an integer >= count ({count})"
            )
        roles[role] = RoleSpec(count, _role_resources(section, role), most)
    roles.setdefault("chief", RoleSpec(1))
    for role in ("ps", "worker"):
        if role not in roles or roles[role].count < 1:
            raise JobSpecError(f"roles.{role}.count must be >= 1 in a {strategy} job")
    for role in ("chief", "evaluator"):
        if role in roles and roles[role].count > 1:
            raise JobSpecError(
                f"roles.{role}.count is {roles[role].count}; a {strategy} job has at most one"
            )
    if roles["chief"].count != 1:
        raise JobSpecError("roles.chief.count must be 1: the chief runs the entrypoint")
    return TfSpec(strategy, {r: roles[r] for r in TF_ROLES if r in roles and roles[r].count})


_KEYS = {
    "roles",
    "distribution_strategy",
    "auto_scale",
    "node_check",
    "exclude_straggler",
    "hang_timeout",
    "delivery_mode",
    "spares",
    "compile_cache",
    "name",
    "entrypoint",
    "args",
    "nodes",
    "nproc_per_node",
    "resources",
    "max_restarts",
    "max_relaunches",
    "oom_memory_factor",
    "oom_max_memory",
    "checkpoint_dir",
    "engine",
    "engine_settings",
}


def job_spec_from_dict(
    raw: Mapping[str, Any], engines: EngineRegistry = BUILTIN_ENGINES
) -> JobSpec:
    """Validate a parsed spec; raises JobSpecError with one message naming the first problem.
    ``engine`` must name a kind of ``engines``."""
    if not isinstance(raw, Mapping):
        raise JobSpecError("the job spec must be a mapping of keys (name, entrypoint, nodes, ...)")
    unknown = set(raw) - _KEYS
    if unknown:
        raise JobSpecError(
            f"unknown keys {sorted(unknown)} in the job spec; allowed: {', '.join(sorted(_KEYS))}"
        )
    entrypoint = raw.get("entrypoint")
    if not entrypoint or not isinstance(entrypoint, str):
        raise JobSpecError(
            "entrypoint is missing: give the training script to run, e.g. entrypoint: train.py"
        )
    engine = raw.get("engine", DEFAULT_ENGINE)
    if engine not in engines:
        raise JobSpecError(f"unknown engine {engine!r}; choose one of {', '.join(engines.names)}")
    name = str(raw.get("name") or _default_name(entrypoint))
    if not _NAME.match(name) or len(name) > 40:
        raise JobSpecError(f"name {name!r} must be 1-40 lowercase letters, digits or '-'")
    args = raw.get("args") or []
    if isinstance(args, str) or not isinstance(args, Sequence):
        raise JobSpecError("args must be a list of strings, e.g. args: [--epochs, '3']")
    entrypoint, args = split_command(entrypoint, [str(a) for a in args])
    min_nodes, max_nodes = parse_nnodes(raw.get("nodes", 1))
    counts = {}
    for key, default, low in (
        ("nproc_per_node", DEFAULT_NPROC_PER_NODE, 1),
        ("max_restarts", DEFAULT_MAX_RESTARTS, 0),
        ("max_relaunches", DEFAULT_MAX_RELAUNCHES, 0),
    ):
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise JobSpecError(f"{key} is {value!r}; it must be an integer >= {low}")
        counts[key] = value
    factor = raw.get("oom_memory_factor", DEFAULT_OOM_MEMORY_FACTOR)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        raise JobSpecError(f"oom_memory_factor is {factor!r}; it must be a number > 1, e.g. 1.5")
    cap = parse_memory_mib(raw.get("oom_max_memory", DEFAULT_OOM_MAX_MEMORY_MIB), "oom_max_memory")
    if cap <= 0:
        raise JobSpecError("oom_max_memory must be > 0, e.g. 64Gi")
    flags = {}
    for key in ("node_check", "exclude_straggler", "auto_scale"):
        value = raw.get(key, False)
        if not isinstance(value, bool):
            raise JobSpecError(f"{key} is {value!r}; it must be true or false")
        flags[key] = value
    hang = raw.get("hang_timeout", "auto")
    try:
        hang_spec = HangSpec.parse(hang)
    except HangSpecError as e:
        raise JobSpecError(
            f"hang_timeout is {hang!r}; it must be seconds >= 0 (0: off), auto, or per phase "
            f"(e.g. {{step: 120, eval: off, min: 10}}): {e}"
        ) from None
    delivery = raw.get("delivery_mode") or ""
    modes = [m.value for m in DeliveryMode]
    if delivery and delivery not in modes:
        raise JobSpecError(f"delivery_mode is {delivery!r}; it must be one of {', '.join(modes)}")
    spares = raw.get("spares", 0)
    if isinstance(spares, bool) or not isinstance(spares, int) or spares < 0:
        raise JobSpecError(f"spares is {spares!r}; it must be an integer >= 0")
    if spares and (flags["auto_scale"] or raw.get("roles") or raw.get("distribution_strategy")):
        raise JobSpecError(
            "spares are hot spare nodes of an all-reduce job at a fixed size: not with "
            "auto_scale or parameter-server roles"
        )
    settings = raw.get("engine_settings") or {}
    if not isinstance(settings, Mapping):
        raise JobSpecError("engine_settings must be a mapping")
    strategy = raw.get("distribution_strategy") or ""
    if not isinstance(strategy, str):
        raise JobSpecError(f"distribution_strategy must be a name, not {strategy!r}")
    if strategy:
        for key in ("nodes", "nproc_per_node", "node_check"):
            if key in raw:
                raise JobSpecError(
                    f"{key} does not apply to a {strategy} job: give each role's count and "
                    "resources under roles (chief, ps, worker, evaluator)"
                )
    roles = _roles(raw.get("roles"), strategy)
    return JobSpec(
        name=name,
        entrypoint=entrypoint,
        args=tuple(str(a) for a in args),
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=counts["nproc_per_node"],
        resources=_resources(raw.get("resources")),
        max_restarts=counts["max_restarts"],
        max_relaunches=counts["max_relaunches"],
        checkpoint_dir=str(raw.get("checkpoint_dir") or ""),
        engine=engine,
        engine_settings=dict(settings),
        oom_memory_factor=float(factor),
        oom_max_memory_mib=cap,
        hang_timeout=hang_spec.text(),
        delivery_mode=str(delivery),
        spares=spares,
        compile_cache=str(raw.get("compile_cache") or ""),
        ps=roles if isinstance(roles, PsSpec) else None,
        tf=roles if isinstance(roles, TfSpec) else None,
        **flags,
    )


PYTHONS = ("python", "python3")
"""Interpreter names a command may start with (the job's own Python runs it)."""


def split_command(entrypoint: str, args: list[str]) -> tuple[str, list[str]]:
    """A command given as one string (``python -m model_zoo.iris --steps 300``, as the original
    DLRover's ElasticJob writes it) split as a shell would: the program, then its arguments
    before ``args``. ``python script.py`` is the script (the job runs it with its Python). An
    entrypoint without spaces, or naming a file that exists, is left as it is."""
    text = entrypoint.strip()
    if not any(ch.isspace() for ch in text) or os.path.exists(text):
        return entrypoint, args
    try:
        parts = shlex.split(text)
    except ValueError as exc:
        raise JobSpecError(
            f"entrypoint {entrypoint!r} cannot be split as a shell would: {exc}"
        ) from None
    if len(parts) > 1 and os.path.basename(parts[0]) in PYTHONS and parts[1].endswith(".py"):
        parts = parts[1:]
    return parts[0], [*parts[1:], *args]


def _default_name(entrypoint: str) -> str:
    stem = os.path.splitext(os.path.basename(entrypoint))[0].lower()
    stem = re.sub(r"[^a-z0-9-]+", "-", stem).strip("-")[:40]
    return stem or "job"


def load_job_spec(path: str | os.PathLike[str]) -> JobSpec:
    """Read and validate a YAML job spec file: a job spec, or an ElasticJob resource
    (`dlrover.elasticjob`)."""
    try:
        with open(path, encoding="utf-8") as file:
            raw = yaml.safe_load(file)
    except OSError as error:
        raise JobSpecError(f"cannot read job spec {os.fspath(path)!r}: {error}") from None
    except yaml.YAMLError as error:
        raise JobSpecError(f"job spec {os.fspath(path)!r} is not valid YAML: {error}") from None
    try:
        # The seeds' ElasticJob resource runs as it is, on any engine.
        return job_spec_from_dict(spec_of(raw) if is_elasticjob(raw) else (raw or {}))
    except (JobSpecError, ElasticJobError) as error:
        raise JobSpecError(f"{os.fspath(path)}: {error}") from None


def job_spec_from_flags(
    entrypoint: str | None,
    args: Sequence[str] = (),
    nnodes: str = "1",
    nproc_per_node: int = DEFAULT_NPROC_PER_NODE,
    engine: str = DEFAULT_ENGINE,
    name: str | None = None,
    cpu: float = 0.0,
    memory: str | int = 0,
    gpu: int = 0,
    max_restarts: int = DEFAULT_MAX_RESTARTS,
    checkpoint_dir: str = "",
    engine_settings: Mapping[str, Any] | None = None,
    node_check: bool = False,
    exclude_straggler: bool = False,
    auto_scale: bool = False,
    ps: int = 0,
    ps_replica: str = DEFAULT_PS_REPLICA,
    hang_timeout: str | float | None = None,
    spares: int = 0,
    compile_cache: str = "",
    delivery_mode: str = "",
) -> JobSpec:
    """The same spec from CLI flags (`dlrover submit --engine ray --nnodes 2:4 train.py`);
    ``ps`` > 0 adds that many embedding servers."""
    raw: dict[str, Any] = {
        "entrypoint": entrypoint,
        "args": list(args),
        "nodes": nnodes,
        "nproc_per_node": nproc_per_node,
        "engine": engine,
        "resources": {"cpu": cpu, "memory": memory, "gpu": gpu},
        "max_restarts": max_restarts,
        "checkpoint_dir": checkpoint_dir,
        "engine_settings": dict(engine_settings or {}),
        "node_check": node_check,
        "exclude_straggler": exclude_straggler,
        "auto_scale": auto_scale,
        "hang_timeout": "auto" if hang_timeout is None else hang_timeout,
        "spares": spares,
        "compile_cache": compile_cache,
        "delivery_mode": delivery_mode,
    }
    if ps:
        raw["roles"] = {"ps": {"count": ps, "replica": ps_replica}}
    if name:
        raw["name"] = name
    return job_spec_from_dict(raw)


def parse_capacity(text: str) -> Capacity:
    """``cpu=8,memory=32Gi`` (either part may be left out) as a Capacity."""
    try:
        return sizes.parse_capacity(text)
    except sizes.SizeError as error:
        raise JobSpecError(str(error)) from None
