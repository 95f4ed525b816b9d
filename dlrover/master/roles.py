"""Role controllers behind one protocol, registered by role (the job asks the registry, not a slot).

A job's nodes come in roles (`worker` of an all-reduce job; `chief`, `ps`, `worker`, `evaluator`
of a TensorFlow job; `ps` embedding servers beside all-reduce workers). Each role is driven by
one controller: the node controller (all-reduce workers), the TensorFlow controller (every role
of its job) or the embedding servers' controller. They implement `RoleController`; the master's
`RoleRegistry` maps a role to its controller, so the master and the node controller route a
scale request or an engine event by role without importing any controller. Every controller
relaunches through the one policy of dlrover/master/relaunch_policy.py.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Protocol, runtime_checkable

from dlrover.engines.base import NodeEvent
from dlrover.master.ps_load import Rates


class RoleController(Protocol):
    """What the master asks of the controller of a role."""

    def on_event(self, event: NodeEvent) -> None:
        """An engine event of a node of the controller's role(s)."""

    def request_scale(self, role: str, count: int) -> tuple[str, int]:
        """Ask for ``count`` nodes of ``role`` (`dlrover scale`): what will happen, and the
        request's id its `dlrover.coordination.ScaleReport` carries. Raises ValueError for what
        cannot be done."""
        ...


@dataclasses.dataclass(frozen=True)
class RoleNode:
    """A node a role controller drives that is no agent of the node table (a TensorFlow job's
    chief, ps, workers and evaluator; embedding servers), as `dlrover status`, /metrics and
    the dashboard show it."""

    node_id: str
    """Its current attempt's node id."""
    role: str
    index: int
    """Its index within the role (the slot)."""
    state: str
    """pending (launched, not serving yet), running, succeeded or failed."""
    relaunches: int
    """Attempts launched after the slot's first."""
    cpu_percent: float = 0.0
    """CPU by its last report (100 = one core); 0.0 before one."""
    memory_bytes: int = 0
    """Resident memory by its last report (embedding servers: their rows' bytes)."""
    memory_limit_bytes: int = 0
    """The attempt's memory limit (0: none asked)."""
    pid: int = 0
    """Its process id on its host, by its last report (0: unknown)."""


@runtime_checkable
class ShowsNodes(Protocol):
    """A role controller whose nodes the job's status lists (`RoleNode`)."""

    def role_nodes(self) -> list[RoleNode]:
        """Each node of the controller's slots now, in role and index order."""
        ...


@runtime_checkable
class MeasuresThroughput(Protocol):
    """A role controller that measures its job's throughput (a TensorFlow job's)."""

    def rates(self) -> Rates:
        """The job's step and sample rates lately."""
        ...


@dataclasses.dataclass(frozen=True)
class ServerStats:
    """One embedding server as its last Stats call saw it (for /metrics and `dlrover status`)."""

    index: int
    address: str
    rows: int
    bytes: int
    lookups: int
    pushes: int
    lookups_per_s: float
    rows_moved_in: int
    rows_moved_out: int
    cpu_percent: float = 0.0
    """The server process's CPU since the previous read (100 = one core)."""
    memory_bytes: int = 0
    """The server process's resident memory."""
    pid: int = 0


@runtime_checkable
class EmbeddingServers(RoleController, Protocol):
    """The controller of a job's embedding servers, as the metrics and the status read it."""

    @property
    def failovers(self) -> int:
        """Servers replaced from a replica so far."""
        ...

    def stats(self) -> list[ServerStats]:
        """Each server's last stats (empty before the first read)."""
        ...


class RoleRegistry:
    """Role name -> its controller, plus at most one controller of the whole job (a TensorFlow
    job's: it answers for any role, also one it refuses to scale). Thread-safe; registering the
    same controller again changes nothing. It serves `RolesApi`."""

    def __init__(self, job_name: str = "none") -> None:
        self._job_name = job_name
        self._lock = threading.Lock()
        self._by_role: dict[str, RoleController] = {}
        self._whole_job: RoleController | None = None

    def register(self, role: str, controller: RoleController | None) -> None:
        """``controller`` drives ``role`` from now on (None: no controller does)."""
        with self._lock:
            if controller is None:
                self._by_role.pop(role, None)
            else:
                self._by_role[role] = controller

    def register_job(self, controller: RoleController | None) -> None:
        """``controller`` drives every role of the job (None: none does)."""
        with self._lock:
            self._whole_job = controller

    def owner(self, role: str) -> RoleController | None:
        """The controller registered for exactly ``role`` (engine events are routed so)."""
        with self._lock:
            return self._by_role.get(role)

    def whole_job(self) -> RoleController | None:
        """The controller of the whole job, if one is registered."""
        with self._lock:
            return self._whole_job

    def controllers(self) -> list[RoleController]:
        """Every registered controller once: the whole job's first, then by role name."""
        with self._lock:
            found: list[RoleController] = [self._whole_job] if self._whole_job else []
            for _, controller in sorted(self._by_role.items()):
                if all(controller is not seen for seen in found):
                    found.append(controller)
            return found

    def get(self, role: str) -> RoleController | None:
        """Who answers for ``role``: the whole job's controller, else the role's own."""
        with self._lock:
            return self._whole_job or self._by_role.get(role)

    def scale_role(self, role: str, count: int) -> tuple[str, int]:
        """Ask for ``count`` nodes of ``role`` (`RolesApi`, `dlrover scale`): what will happen,
        and the request's id its report will carry. Raises ValueError for a role that cannot be
        scaled so."""
        controller = self.get(role)
        if controller is not None:
            return controller.request_scale(role, count)
        if role != "ps":
            raise ValueError(
                f"role {role!r}: only ps (embedding servers) is scaled on request; workers scale "
                "within --nnodes MIN:MAX (dlrover submit --auto-scale)"
            )
        raise ValueError(
            f"job {self._job_name} has no embedding servers (roles.ps in the job spec, "
            "or dlrover submit --ps N)"
        )

    def embedding_servers(self) -> EmbeddingServers | None:
        """The embedding servers' controller, in a job with a ps role of its own (metrics,
        status)."""
        with self._lock:
            owner = self._by_role.get("ps")
        return owner if isinstance(owner, EmbeddingServers) else None

    def role_nodes(self) -> list[RoleNode]:
        """The nodes role controllers drive beside the agents of the node table (a TensorFlow
        job's every role, embedding servers): what status, /metrics and the dashboard add."""
        rows: list[RoleNode] = []
        for controller in self.controllers():
            if isinstance(controller, ShowsNodes):
                rows.extend(controller.role_nodes())
        return rows

    def rates(self) -> Rates:
        """The job's step and sample rates lately, where a role controller measures them (a
        TensorFlow job's chief reports its progress); zeros otherwise."""
        controller = self.whole_job()
        return controller.rates() if isinstance(controller, MeasuresThroughput) else Rates()
