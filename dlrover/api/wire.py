"""The master's wire: the mapper between domain types and messages, and the table of its RPCs.

The field-by-name rule of `dlrover.api.mapper` converts every type but two; the names where a
message differs from its dataclass are listed here, and so are the two hand-written reads.
"""

from __future__ import annotations

from dlrover.api import master as api
from dlrover.api.mapper import Custom, Mapper
from dlrover.api.rpc import Rpc, rpcs
from dlrover.api.sharding import ShardingTransport, StreamTransport
from dlrover.proto import master_pb2 as pb


def _registration_from_pb(request: pb.RegisterNodeRequest) -> api.Registration:
    """A config with max_nodes 0 means no limits given; an empty role is the default one."""
    given = request.HasField("config") and request.config.max_nodes > 0
    return api.Registration(
        host=request.host,
        local_world_size=request.local_world_size,
        node_id=request.node_id,
        role=request.role or "default",
        requested_rank=request.requested_rank,
        pid=request.pid,
        limits=MAPPER.from_message(request.config, api.NodeLimits) if given else None,
        job_name=request.config.job_name,
    )


def _heartbeat_reply_from_pb(response: pb.HeartbeatResponse) -> api.HeartbeatReply:
    """An action this client does not know reads as NONE."""
    try:
        action = api.HeartbeatAction(response.action)
    except ValueError:
        action = api.HeartbeatAction.NONE  # an action of a newer master: nothing we know to do
    return api.HeartbeatReply(
        action, response.job_state, response.heartbeat_interval_s, response.heartbeat_port
    )


_CONFIG = {"limits": "config", "job_name": "config.job_name"}

MAPPER = Mapper(
    paths={
        api.Registration: _CONFIG,
        api.Registered: _CONFIG,
        api.HeartbeatReport: {
            "cpu_percent": "usage.cpu_percent",
            "memory_bytes": "usage.memory_bytes",
        },
        api.NodeReport: {"outcome": "status"},
    },
    custom={
        api.Registration: Custom(from_message=_registration_from_pb),
        api.HeartbeatReply: Custom(from_message=_heartbeat_reply_from_pb),
    },
)
"""The one mapper both sides use."""

RPCS: dict[str, Rpc] = rpcs(*api.MASTER_PARTS, ShardingTransport, StreamTransport, mapper=MAPPER)
"""Every RPC of the master's service, by the interface method that is its source."""

# Conversions by name, as tests and tools have called them.
registration_to_pb, registration_from_pb = MAPPER.pair(api.Registration, pb.RegisterNodeRequest)
registered_to_pb, registered_from_pb = MAPPER.pair(api.Registered, pb.RegisterNodeResponse)
heartbeat_to_pb, heartbeat_from_pb = MAPPER.pair(api.HeartbeatReport, pb.HeartbeatRequest)
heartbeat_reply_to_pb, heartbeat_reply_from_pb = MAPPER.pair(
    api.HeartbeatReply, pb.HeartbeatResponse
)
join_to_pb, join_from_pb = MAPPER.pair(api.JoinRequest, pb.JoinRendezvousRequest)
world_to_pb, world_from_pb = MAPPER.pair(api.CommWorld, pb.CommWorld)
node_report_to_pb, node_report_from_pb = MAPPER.pair(api.NodeReport, pb.ReportNodeStatusRequest)
job_status_to_pb, job_status_from_pb = MAPPER.pair(api.JobStatus, pb.JobStatus)
failure_to_pb, failure_from_pb = MAPPER.pair(api.FailureRecord, pb.FailureRecord)
