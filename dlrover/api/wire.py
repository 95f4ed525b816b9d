"""Conversions between the domain types of `dlrover.api.master` and the gRPC messages.

The one place that knows both: the client and the servicer call these and never build each
other's messages field by field.
"""

from __future__ import annotations

from dlrover.api import master as api
from dlrover.proto import master_pb2 as pb


def limits_to_pb(limits: api.NodeLimits, job_name: str = "") -> pb.JobConfig:
    """The job's node range (and name) as the wire's JobConfig."""
    return pb.JobConfig(
        min_nodes=limits.min_nodes,
        max_nodes=limits.max_nodes,
        node_unit=limits.node_unit,
        last_call_timeout_s=limits.last_call_timeout_s,
        job_name=job_name,
    )


def limits_from_pb(config: pb.JobConfig) -> api.NodeLimits:
    """A JobConfig back into NodeLimits (the job name is read separately)."""
    return api.NodeLimits(
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        node_unit=config.node_unit,
        last_call_timeout_s=config.last_call_timeout_s,
    )


def registration_to_pb(r: api.Registration) -> pb.RegisterNodeRequest:
    """A Registration as a RegisterNodeRequest; limits travel only when given."""
    request = pb.RegisterNodeRequest(
        node_id=r.node_id,
        host=r.host,
        role=r.role,
        local_world_size=r.local_world_size,
        requested_rank=r.requested_rank,
        pid=r.pid,
    )
    if r.limits is not None:
        request.config.CopyFrom(limits_to_pb(r.limits, r.job_name))
    return request


def registration_from_pb(request: pb.RegisterNodeRequest) -> api.Registration:
    """A RegisterNodeRequest as a Registration; a config with max_nodes 0 means no limits given."""
    given = request.HasField("config") and request.config.max_nodes > 0
    return api.Registration(
        host=request.host,
        local_world_size=request.local_world_size,
        node_id=request.node_id,
        role=request.role or "default",
        requested_rank=request.requested_rank,
        pid=request.pid,
        limits=limits_from_pb(request.config) if given else None,
        job_name=request.config.job_name,
    )


def registered_to_pb(r: api.Registered) -> pb.RegisterNodeResponse:
    """The master's registration answer as a RegisterNodeResponse."""
    return pb.RegisterNodeResponse(
        node_id=r.node_id, incarnation=r.incarnation, config=limits_to_pb(r.limits, r.job_name)
    )


def registered_from_pb(response: pb.RegisterNodeResponse) -> api.Registered:
    """A RegisterNodeResponse back into Registered."""
    return api.Registered(
        node_id=response.node_id,
        incarnation=response.incarnation,
        limits=limits_from_pb(response.config),
        job_name=response.config.job_name,
    )


def heartbeat_to_pb(h: api.HeartbeatReport) -> pb.HeartbeatRequest:
    """A HeartbeatReport as a HeartbeatRequest."""
    return pb.HeartbeatRequest(
        node_id=h.node_id,
        incarnation=h.incarnation,
        usage=pb.ResourceUsage(cpu_percent=h.cpu_percent, memory_bytes=h.memory_bytes),
        step=h.step,
        worker_state=h.worker_state,
        restart_count=h.restart_count,
    )


def heartbeat_from_pb(request: pb.HeartbeatRequest) -> api.HeartbeatReport:
    """A HeartbeatRequest back into a HeartbeatReport."""
    return api.HeartbeatReport(
        node_id=request.node_id,
        incarnation=request.incarnation,
        cpu_percent=request.usage.cpu_percent,
        memory_bytes=request.usage.memory_bytes,
        step=request.step,
        worker_state=request.worker_state,
        restart_count=request.restart_count,
    )


def heartbeat_reply_from_pb(response: pb.HeartbeatResponse) -> api.HeartbeatReply:
    """A HeartbeatResponse as a HeartbeatReply; an action this client does not know reads as
    NONE."""
    try:
        action = api.HeartbeatAction(response.action)
    except ValueError:
        action = api.HeartbeatAction.NONE  # an action of a newer master: nothing we know to do
    return api.HeartbeatReply(action=action, job_state=response.job_state)


def join_to_pb(j: api.JoinRequest) -> pb.JoinRendezvousRequest:
    """A JoinRequest as a JoinRendezvousRequest."""
    return pb.JoinRendezvousRequest(
        node_id=j.node_id,
        incarnation=j.incarnation,
        local_world_size=j.local_world_size,
        store_host=j.store_host,
        store_port=j.store_port,
    )


def join_from_pb(request: pb.JoinRendezvousRequest) -> api.JoinRequest:
    """A JoinRendezvousRequest back into a JoinRequest."""
    return api.JoinRequest(
        node_id=request.node_id,
        incarnation=request.incarnation,
        local_world_size=request.local_world_size,
        store_host=request.store_host,
        store_port=request.store_port,
    )


def world_to_pb(w: api.CommWorld) -> pb.CommWorld:
    """A CommWorld as its wire message."""
    return pb.CommWorld(
        round=w.round,
        complete=w.complete,
        members=[
            pb.WorldMember(
                node_id=m.node_id,
                node_rank=m.node_rank,
                local_world_size=m.local_world_size,
                host=m.host,
            )
            for m in w.members
        ],
        node_rank=w.node_rank,
        world_size=w.world_size,
        rank_offset=w.rank_offset,
        store_host=w.store_host,
        store_port=w.store_port,
    )


def world_from_pb(w: pb.CommWorld) -> api.CommWorld:
    """A CommWorld message back into the domain CommWorld."""
    return api.CommWorld(
        round=w.round,
        complete=w.complete,
        members=tuple(
            api.WorldMember(
                node_id=m.node_id,
                node_rank=m.node_rank,
                local_world_size=m.local_world_size,
                host=m.host,
            )
            for m in w.members
        ),
        node_rank=w.node_rank,
        world_size=w.world_size,
        rank_offset=w.rank_offset,
        store_host=w.store_host,
        store_port=w.store_port,
    )


def node_report_to_pb(r: api.NodeReport) -> pb.ReportNodeStatusRequest:
    """A NodeReport as a ReportNodeStatusRequest."""
    return pb.ReportNodeStatusRequest(
        node_id=r.node_id,
        incarnation=r.incarnation,
        status=r.outcome.value,
        exit_code=r.exit_code,
        reason=r.reason,
    )


def node_report_from_pb(request: pb.ReportNodeStatusRequest) -> api.NodeReport:
    """A ReportNodeStatusRequest as a NodeReport; raises ValueError for an unknown status."""
    try:
        outcome = api.NodeOutcome(request.status)
    except ValueError:
        raise ValueError(
            f"unknown node status {request.status!r}: use succeeded or failed"
        ) from None
    return api.NodeReport(
        node_id=request.node_id,
        incarnation=request.incarnation,
        outcome=outcome,
        exit_code=request.exit_code,
        reason=request.reason,
    )


def job_status_to_pb(s: api.JobStatus) -> pb.JobStatus:
    """A JobStatus (with its nodes) as its wire message."""
    return pb.JobStatus(
        job_name=s.job_name,
        state=s.state,
        round=s.round,
        reason=s.reason,
        exit_code=s.exit_code,
        nodes=[
            pb.NodeStatus(
                node_id=n.node_id,
                state=n.state,
                node_rank=n.node_rank,
                host=n.host,
                step=n.step,
                restart_count=n.restart_count,
                last_heartbeat_age_s=n.last_heartbeat_age_s,
                role=n.role,
                cpu_percent=n.cpu_percent,
                memory_bytes=n.memory_bytes,
            )
            for n in s.nodes
        ],
    )


def job_status_from_pb(s: pb.JobStatus) -> api.JobStatus:
    """A JobStatus message back into the domain JobStatus."""
    return api.JobStatus(
        job_name=s.job_name,
        state=s.state,
        round=s.round,
        reason=s.reason,
        exit_code=s.exit_code,
        nodes=tuple(
            api.NodeStatus(
                node_id=n.node_id,
                state=n.state,
                node_rank=n.node_rank,
                host=n.host,
                step=n.step,
                restart_count=n.restart_count,
                last_heartbeat_age_s=n.last_heartbeat_age_s,
                role=n.role,
                cpu_percent=n.cpu_percent,
                memory_bytes=n.memory_bytes,
            )
            for n in s.nodes
        ),
    )
