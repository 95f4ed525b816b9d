"""Engines by name: each kind's typed settings, factory, addresses and log reader (no switches)."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

from dlrover.constants import DEFAULT_RAY_NAMESPACE
from dlrover.engines.base import Capacity, Engine
from dlrover.engines.node_logs import LocalNodeLogs, NodeLogs
from dlrover.engines.sizes import parse_capacity

LogReader = NodeLogs
"""Where the dashboard and `dlrover logs` read a job's node logs (`NodeLogs`)."""

SettingsT = TypeVar("SettingsT")

LOOPBACK = "127.0.0.1"
ALL_INTERFACES = "0.0.0.0"


class EngineSettingsError(ValueError):
    """``engine_settings`` that the engine cannot start with; the message names the key."""


class UnknownEngineError(ValueError):
    """A job spec names an engine no registered kind has; the message lists the names."""


@dataclasses.dataclass(frozen=True)
class EngineKind(Generic[SettingsT]):
    """One engine a job spec may name: how its ``engine_settings`` read, how it starts, and
    where a job's master and nodes reach each other. Adding an engine is one new kind."""

    name: str
    """What ``engine:`` in a job spec says."""
    read_settings: Callable[[Mapping[str, Any]], SettingsT]
    """``engine_settings`` -> this kind's typed settings; raises EngineSettingsError."""
    factory: Callable[[str, Path, SettingsT], Engine]
    """``(job name, job directory, settings)`` -> a started engine."""
    loopback: bool = False
    """Nodes run on the master's machine: they reach it on 127.0.0.1 and their own servers
    (embedding servers, TensorFlow tasks) listen there only."""
    log_reader: Callable[[Path], LogReader] | None = None
    """``job directory`` -> the dashboard's reader of node logs, for kinds whose logs the
    master's machine holds."""
    master_on_cluster: bool = False
    """`dlrover submit` starts the job's master on the engine's cluster (a Ray actor that the
    cluster restarts) instead of serving it from the submitting machine."""

    def settings(self, raw: Mapping[str, Any]) -> SettingsT:
        """The typed settings of ``raw`` (a job spec's ``engine_settings``)."""
        return self.read_settings(raw)

    def create(self, job_name: str, job_dir: Path, raw: Mapping[str, Any]) -> Engine:
        """A started engine for job ``job_name`` with settings ``raw``."""
        return self.factory(job_name, job_dir, self.read_settings(raw))

    @property
    def node_host(self) -> str:
        """The address a node's own server listens on."""
        return LOOPBACK if self.loopback else ALL_INTERFACES

    def master_host(self) -> str:
        """The host nodes reach the master by, when nobody said (this machine's address)."""
        if self.loopback:
            return LOOPBACK
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return socket.getfqdn()

    def logs(self, job_dir: Path) -> LogReader | None:
        """The dashboard's reader of this job's node logs, or None."""
        return self.log_reader(job_dir) if self.log_reader is not None else None


class EngineRegistry:
    """Engine kinds by name. Immutable: `with_kind` returns a new registry, so no process-wide
    table changes under anybody (pass the registry you built to `JobRunner`)."""

    def __init__(self, kinds: Iterable[EngineKind[Any]]) -> None:
        self._kinds: dict[str, EngineKind[Any]] = {}
        for kind in kinds:
            self._kinds[kind.name] = kind

    @property
    def names(self) -> tuple[str, ...]:
        """The names a job spec may give, in registration order."""
        return tuple(self._kinds)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._kinds

    def get(self, name: str) -> EngineKind[Any]:
        """The kind registered as ``name``; UnknownEngineError lists the others."""
        try:
            return self._kinds[name]
        except (KeyError, TypeError):
            raise UnknownEngineError(
                f"unknown engine {name!r}; choose one of {', '.join(self._kinds)}"
            ) from None

    def with_kind(self, kind: EngineKind[Any]) -> EngineRegistry:
        """This registry plus ``kind`` (replacing a kind of the same name)."""
        return EngineRegistry([*(k for k in self._kinds.values() if k.name != kind.name), kind])


# --- the built-in kinds ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LocalSettings:
    """``engine: local``: nodes are processes on this machine."""

    capacity: Capacity = dataclasses.field(default_factory=Capacity)
    """What all nodes together may use (``capacity: cpu=8,memory=32Gi``); unknown by default."""

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> LocalSettings:
        """Read ``engine_settings`` (``capacity``)."""
        return cls(parse_capacity(str(raw.get("capacity", ""))))


def _local_engine(job_name: str, job_dir: Path, settings: LocalSettings) -> Engine:
    from dlrover.engines.local import LocalEngine

    return LocalEngine(job_dir / "nodes", capacity=settings.capacity)


def local_log_reader(job_dir: Path) -> LocalNodeLogs:
    """A local-engine job's node logs in its directory: each agent's stderr and its workers'
    per-rank logs."""
    return LocalNodeLogs(job_dir / "nodes")


@dataclasses.dataclass(frozen=True)
class RaySettings:
    """``engine: ray``: nodes are Ray actors; the master is a Ray actor too."""

    address: str | None = None
    """The Ray cluster (None: a running local one, else a new one)."""
    namespace: str = DEFAULT_RAY_NAMESPACE
    """The Ray namespace of the job's actors."""
    state: str = ""
    """The master's state (``redis://...`` so a master on another Ray node finds it; "": SQLite
    in the job's directory)."""

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> RaySettings:
        """Read ``engine_settings`` (``address``, ``namespace``, ``state``)."""
        return cls(
            address=raw.get("address"),
            namespace=str(raw.get("namespace") or DEFAULT_RAY_NAMESPACE),
            state=str(raw.get("state") or ""),
        )


def _ray_engine(job_name: str, job_dir: Path, settings: RaySettings) -> Engine:
    from dlrover.engines.ray_engine import RayEngine

    return RayEngine(address=settings.address)


@dataclasses.dataclass(frozen=True)
class KubernetesSettings:
    """``engine: kubernetes``: nodes are pods."""

    image: str
    """The container image holding dlrover and the training code (required)."""
    namespace: str = "default"
    service_account: str = ""
    launch_rate: float = 20.0
    """Pods the master creates a second at most (a lost rack's replacements are queued and
    handed over at this rate; a 429 is retried, not a failure)."""

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> KubernetesSettings:
        """Read ``engine_settings`` (``image``, ``namespace``, ``service_account``,
        ``launch_rate``)."""
        if "image" not in raw:
            raise EngineSettingsError(
                "engine kubernetes needs engine_settings.image (the container image)"
            )
        return cls(
            image=str(raw["image"]),
            namespace=str(raw.get("namespace", "default")),
            service_account=str(raw.get("service_account", "")),
            launch_rate=_positive(raw.get("launch_rate", 20.0), "launch_rate"),
        )


def _positive(value: Any, name: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = 0.0
    if not number > 0:
        raise EngineSettingsError(
            f"engine_settings.{name} must be a number above 0 (pods a second), not {value!r}"
        )
    return number


def _kubernetes_engine(job_name: str, job_dir: Path, settings: KubernetesSettings) -> Engine:
    from dlrover.engines.kube_manifests import PodSettings
    from dlrover.engines.kubernetes_engine import KubernetesEngine

    engine = KubernetesEngine.from_environment(
        job_name,
        PodSettings(
            image=settings.image,
            namespace=settings.namespace,
            service_account=settings.service_account,
        ),
    )
    engine.launch_rate = settings.launch_rate
    return engine


LOCAL = EngineKind("local", LocalSettings.from_mapping, _local_engine, True, local_log_reader)
"""Processes on this machine (the default)."""
RAY = EngineKind("ray", RaySettings.from_mapping, _ray_engine, master_on_cluster=True)
"""Actors on a Ray cluster."""
KUBERNETES = EngineKind("kubernetes", KubernetesSettings.from_mapping, _kubernetes_engine)
"""Pods on a Kubernetes cluster."""

BUILTIN_ENGINES = EngineRegistry((LOCAL, RAY, KUBERNETES))
"""The engines DLRover ships; `EngineRegistry.with_kind` adds yours."""


def node_host(engine: str, engines: EngineRegistry = BUILTIN_ENGINES) -> str:
    """The address a node's own server listens on under ``engine`` (every interface for a name
    ``engines`` does not know)."""
    return engines.get(engine).node_host if engine in engines else ALL_INTERFACES
