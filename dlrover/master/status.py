"""The master's status part: the job as `dlrover status`, the dashboard and tools see it now."""

from __future__ import annotations

from collections.abc import Callable

from dlrover.api import master as api
from dlrover.master.diagnostics import Diagnostics
from dlrover.master.lifecycle import JobLifecycle
from dlrover.master.membership import Membership
from dlrover.master.preflight import Preflight
from dlrover.master.roles import RoleRegistry


class JobStatusView:
    """Reads every part into one `JobStatus` (it serves `StatusApi`); keeps nothing but where
    the dashboard is served (`serve_metrics_on`)."""

    def __init__(
        self,
        job_name: str,
        clock: Callable[[], float],
        lifecycle: JobLifecycle,
        members: Membership,
        preflight: Preflight,
        diagnostics: Diagnostics,
        roles: RoleRegistry,
        data_lost: Callable[[], str] = lambda: "",
    ) -> None:
        self._job_name = job_name
        self._clock = clock
        self._lifecycle = lifecycle
        self._members = members
        self._preflight = preflight
        self._diagnostics = diagnostics
        self._roles = roles
        self._data_lost = data_lost
        self.metrics_port = 0
        """Where /metrics and the dashboard are served (0: nowhere)."""

    def serve_metrics_on(self, port: int) -> None:
        """Say that /metrics and the dashboard are served on ``port`` (the status reports it)."""
        self.metrics_port = port

    def get_job_status(self, with_nodes: bool = True) -> api.JobStatus:
        """The job and (``with_nodes``) every node now; heartbeat ages come from the master's
        clock."""
        now = self._clock()
        scores = self._diagnostics.straggler_scores()
        rates = self._roles.rates()
        words = self._preflight.words
        rendezvous = self._members.rendezvous
        servers = self._roles.embedding_servers()
        life = self._lifecycle
        return api.JobStatus(
            job_name=self._job_name,
            state=life.state.value,
            round=rendezvous.round if rendezvous else 0,
            reason=life.reason,
            exit_code=life.exit_code,
            nodes=tuple(
                api.NodeStatus(
                    node_id=n.node_id,
                    # A node waiting while a round runs at max nodes without it: a hot spare.
                    state="spare"
                    if rendezvous is not None and rendezvous.is_spare(n.node_id)
                    else n.state.value,
                    node_rank=n.node_rank,
                    host=n.host,
                    step=n.step,
                    restart_count=n.restart_count,
                    last_heartbeat_age_s=max(0.0, now - n.last_heartbeat),
                    role=n.role,
                    cpu_percent=n.cpu_percent,
                    memory_bytes=n.memory_bytes,
                    check=words.get(n.node_id, ""),
                    score=scores[n.node_id].relative if n.node_id in scores else 0.0,
                    step_wall_s=n.breakdown[0],
                    step_data_s=n.breakdown[1],
                    step_checkpoint_s=n.breakdown[2],
                    samples_per_s=n.samples_per_s,
                    pid=n.pid,
                    worker_pids=n.worker_pids,
                )
                for n in (self._members.nodes.all() if with_nodes else ())
            )
            + tuple(
                api.NodeStatus(
                    node_id=r.node_id,
                    state=r.state,
                    node_rank=r.index,
                    host="",
                    step=-1,
                    restart_count=r.relaunches,
                    last_heartbeat_age_s=0.0,
                    role=r.role,
                    cpu_percent=r.cpu_percent,
                    memory_bytes=r.memory_bytes,
                    pid=r.pid,
                    memory_limit_bytes=r.memory_limit_bytes,
                )
                for r in (self._roles.role_nodes() if with_nodes else ())
            ),
            node_check=self._preflight.summary,
            autoscale=self._diagnostics.scale_summary,
            goodput=self._diagnostics.goodput.snapshot(now).ratio,
            metrics_port=self.metrics_port,
            embedding_servers=tuple(
                api.EmbeddingServerStatus(s.index, s.address, s.rows, s.bytes, s.lookups_per_s)
                for s in (servers.stats() if servers is not None else ())
            ),
            steps_per_s=rates.steps_per_s,
            samples_per_s=rates.samples_per_s,
            data_lost=self._data_lost(),
        )
