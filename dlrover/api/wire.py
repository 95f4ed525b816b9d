"""Conversions between the domain types of `dlrover.api.master` and the gRPC messages.

The one place that knows both: the client and the servicer call these and never build each
other's messages field by field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from dlrover.api import master as api
from dlrover.proto import master_pb2 as pb


def _scalars(value: object, names: Iterable[str]) -> dict[str, Any]:
    """The named attributes of ``value``: for types whose fields match one for one."""
    return {name: getattr(value, name) for name in names}


def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def limits_to_pb(limits: api.NodeLimits, job_name: str = "") -> pb.JobConfig:
    """The job's node range (and name) as the wire's JobConfig."""
    return pb.JobConfig(job_name=job_name, **dataclasses.asdict(limits))


def limits_from_pb(config: pb.JobConfig) -> api.NodeLimits:
    """The node range a JobConfig carries (its job name is read separately)."""
    return api.NodeLimits(**_scalars(config, _names(api.NodeLimits)))


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
        node_id=r.node_id,
        incarnation=r.incarnation,
        config=limits_to_pb(r.limits, r.job_name),
        heartbeat_interval_s=r.heartbeat_interval_s,
    )


def registered_from_pb(response: pb.RegisterNodeResponse) -> api.Registered:
    """A RegisterNodeResponse back into Registered."""
    return api.Registered(
        node_id=response.node_id,
        incarnation=response.incarnation,
        limits=limits_from_pb(response.config),
        job_name=response.config.job_name,
        heartbeat_interval_s=response.heartbeat_interval_s,
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
        step_time_s=h.step_time_s,
        attempt_step=h.attempt_step,
        attempt_step_age_s=h.attempt_step_age_s,
        attempt_first_step=h.attempt_first_step,
        attempt_first_age_s=h.attempt_first_age_s,
        step_wall_s=h.step_wall_s,
        step_data_s=h.step_data_s,
        step_checkpoint_s=h.step_checkpoint_s,
        checkpoint_persist_s=h.checkpoint_persist_s,
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
        step_time_s=request.step_time_s,
        attempt_step=request.attempt_step,
        attempt_step_age_s=request.attempt_step_age_s,
        attempt_first_step=request.attempt_first_step,
        attempt_first_age_s=request.attempt_first_age_s,
        step_wall_s=request.step_wall_s,
        step_data_s=request.step_data_s,
        step_checkpoint_s=request.step_checkpoint_s,
        checkpoint_persist_s=request.checkpoint_persist_s,
    )


def heartbeat_reply_from_pb(response: pb.HeartbeatResponse) -> api.HeartbeatReply:
    """A HeartbeatResponse as a HeartbeatReply; an action this client does not know reads as
    NONE."""
    try:
        action = api.HeartbeatAction(response.action)
    except ValueError:
        action = api.HeartbeatAction.NONE  # an action of a newer master: nothing we know to do
    return api.HeartbeatReply(
        action=action,
        job_state=response.job_state,
        heartbeat_interval_s=response.heartbeat_interval_s,
    )


def heartbeat_reply_to_pb(reply: api.HeartbeatReply) -> pb.HeartbeatResponse:
    """A HeartbeatReply as its gRPC message."""
    return pb.HeartbeatResponse(
        action=reply.action.value,
        job_state=reply.job_state,
        heartbeat_interval_s=reply.heartbeat_interval_s,
    )


def join_to_pb(j: api.JoinRequest) -> pb.JoinRendezvousRequest:
    """A join request as its gRPC message."""
    return pb.JoinRendezvousRequest(**dataclasses.asdict(j))


def join_from_pb(request: pb.JoinRendezvousRequest) -> api.JoinRequest:
    """A JoinRendezvousRequest as the domain type."""
    return api.JoinRequest(**_scalars(request, _names(api.JoinRequest)))


def world_to_pb(w: api.CommWorld) -> pb.CommWorld:
    """A rendezvous round as one node sees it, as its gRPC message."""
    return pb.CommWorld(**_scalars(w, _names(api.CommWorld)))


def world_from_pb(w: pb.CommWorld) -> api.CommWorld:
    """A CommWorld message as the domain type."""
    return api.CommWorld(**_scalars(w, _names(api.CommWorld)))


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
    """The job's status as its gRPC message."""
    lists = ("nodes", "embedding_servers")
    fields = {name: getattr(s, name) for name in _names(api.JobStatus) if name not in lists}
    nodes = [pb.NodeStatus(**dataclasses.asdict(n)) for n in s.nodes]
    servers = [pb.EmbeddingServerStatus(**dataclasses.asdict(e)) for e in s.embedding_servers]
    return pb.JobStatus(nodes=nodes, embedding_servers=servers, **fields)


def job_status_from_pb(s: pb.JobStatus) -> api.JobStatus:
    """A JobStatus message as the domain type."""
    lists = ("nodes", "embedding_servers")
    fields = _scalars(s, [name for name in _names(api.JobStatus) if name not in lists])
    node_names = _names(api.NodeStatus)
    nodes = tuple(api.NodeStatus(**_scalars(n, node_names)) for n in s.nodes)
    server_names = _names(api.EmbeddingServerStatus)
    servers = tuple(
        api.EmbeddingServerStatus(**_scalars(e, server_names)) for e in s.embedding_servers
    )
    return api.JobStatus(nodes=nodes, embedding_servers=servers, **fields)


def check_join_to_pb(j: api.NodeCheckJoin, wait_s: float) -> pb.JoinNodeCheckRequest:
    """A node-check join as its gRPC message, asking the master to hold it ``wait_s``."""
    return pb.JoinNodeCheckRequest(wait_s=wait_s, **dataclasses.asdict(j))


def check_join_from_pb(request: pb.JoinNodeCheckRequest) -> api.NodeCheckJoin:
    """A JoinNodeCheckRequest as the domain type (its wait_s is read separately)."""
    return api.NodeCheckJoin(**_scalars(request, _names(api.NodeCheckJoin)))


def check_task_to_pb(t: api.NodeCheckTask) -> pb.NodeCheckTask:
    """A node-check task as its gRPC message."""
    fields = _scalars(t, _names(api.NodeCheckTask))
    return pb.NodeCheckTask(**{**fields, "state": t.state.value, "peers": list(t.peers)})


def check_task_from_pb(t: pb.NodeCheckTask) -> api.NodeCheckTask:
    """A NodeCheckTask message as the domain type; raises ValueError for an unknown state."""
    fields = _scalars(t, _names(api.NodeCheckTask))
    return api.NodeCheckTask(
        **{**fields, "state": api.NodeCheckState(t.state), "peers": tuple(t.peers)}
    )


def check_report_to_pb(r: api.NodeCheckReport) -> pb.ReportNodeCheckRequest:
    """A node-check result as its gRPC message."""
    return pb.ReportNodeCheckRequest(**dataclasses.asdict(r))


def check_report_from_pb(request: pb.ReportNodeCheckRequest) -> api.NodeCheckReport:
    """A ReportNodeCheckRequest as the domain type."""
    return api.NodeCheckReport(**_scalars(request, _names(api.NodeCheckReport)))


def failure_to_pb(r: api.FailureRecord) -> pb.FailureRecord:
    """A failure record as its gRPC message."""
    fields = _scalars(r, _names(api.FailureRecord))
    return pb.FailureRecord(**{**fields, "failure_class": r.failure_class.value})


def failure_from_pb(r: pb.FailureRecord) -> api.FailureRecord:
    """A FailureRecord message as the domain type; raises ValueError for an unknown class."""
    fields = _scalars(r, _names(api.FailureRecord))
    return api.FailureRecord(**{**fields, "failure_class": api.FailureClass(r.failure_class)})
