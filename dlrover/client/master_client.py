"""The one wire client to the job master, used by agents and training processes alike."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from dlrover.api import master as api
from dlrover.api import wire
from dlrover.api.errors import (
    MasterClientError,
    MasterRequestError,
    MasterUnreachableError,
    UnknownNodeError,
    WrongTokenError,
)
from dlrover.constants import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_RPC_TIMEOUT_S,
    ENV_JOB_TOKEN,
    ENV_MASTER_ADDR,
    ENV_NODE_ID,
    MAX_LONG_POLL_S,
    MAX_MESSAGE_BYTES,
    TOKEN_METADATA_KEY,
)
from dlrover.proto import master_pb2 as pb
from dlrover.proto import master_pb2_grpc as pb_grpc
from dlrover.worker_context import WorkerContext

__all__ = [
    "MasterClient",
    "MasterClientError",
    "MasterRequestError",
    "MasterUnreachableError",
    "UnknownNodeError",
    "WrongTokenError",
]

CHECKPOINT_WAIT_S = 5.0
"""One checkpoint wait held in the master; the client asks again until its own deadline."""

T = TypeVar("T")


class MasterClient:
    """`dlrover.api.master.MasterApi` over gRPC: domain types in and out, protobuf stays inside.

    Every call has a deadline and carries the job token; failures raise the errors of
    `dlrover.api.errors` with a message that says what to do.
    """

    def __init__(
        self,
        addr: str,
        token: str,
        rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
    ) -> None:
        if not addr or ":" not in addr:
            raise MasterClientError(f"bad master address {addr!r}: expected host:port")
        self.addr = addr
        self._metadata = ((TOKEN_METADATA_KEY, token),)
        self._timeout = rpc_timeout_s
        self._channel = grpc.insecure_channel(
            addr,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.enable_http_proxy", 0),
                # A restarted master is found again within a second, not after gRPC's default
                # back-off of up to two minutes.
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ],
        )
        self.stub = pb_grpc.MasterStub(self._channel)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> MasterClient:
        """The master the launching agent pointed this process at."""
        env = dict(os.environ) if env is None else env
        addr = env.get(ENV_MASTER_ADDR, "")
        if not addr:
            raise MasterClientError(
                f"{ENV_MASTER_ADDR} is not set: run this process under dlrover-run, or export "
                "the address dlrover-master printed"
            )
        return cls(addr, env.get(ENV_JOB_TOKEN, ""))

    def wait_ready(self, timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
        """Block until the master answers, or raise MasterUnreachableError naming the address."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise MasterUnreachableError(
                f"cannot reach the DLRover master at {self.addr} within {timeout_s:.0f}s: "
                f"is dlrover-master running there, and is {ENV_MASTER_ADDR} right?"
            ) from None
        # A call proves the token too, so a wrong one fails here with a clear message.
        self.get_job_status()

    def close(self) -> None:
        """Close the channel; calls after this fail."""
        self._channel.close()

    def call(self, fn: Callable[..., T], request: object, timeout_s: float | None = None) -> T:
        """One RPC of `stub` with this client's deadline and token; gRPC failures become the
        errors of `dlrover.api.errors`. For wire adapters beside this one (the sharding
        transport); everything else uses the typed methods."""
        try:
            return fn(request, timeout=timeout_s or self._timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            details = e.details() if hasattr(e, "details") else str(e)
            if code == grpc.StatusCode.UNAUTHENTICATED:
                raise WrongTokenError(
                    f"the master at {self.addr} refused the job token: set {ENV_JOB_TOKEN} to the "
                    "token dlrover-master printed"
                ) from None
            if code == grpc.StatusCode.NOT_FOUND:
                raise UnknownNodeError(str(details)) from None
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                raise MasterRequestError(str(details)) from None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise MasterUnreachableError(
                    f"the DLRover master at {self.addr} did not answer ({details})"
                ) from None
            raise MasterClientError(
                f"call to the master at {self.addr} failed: {details}"
            ) from None

    # --- agent calls ---------------------------------------------------------------------------
    def register_node(self, registration: api.Registration) -> api.Registered:
        """Register this agent (RegisterNode RPC; see MasterApi.register_node)."""
        request = wire.registration_to_pb(registration)
        return wire.registered_from_pb(self.call(self.stub.RegisterNode, request))

    def heartbeat(self, report: api.HeartbeatReport) -> api.HeartbeatReply:
        """Send a heartbeat (Heartbeat RPC); an action this client does not know reads as NONE."""
        response = self.call(self.stub.Heartbeat, wire.heartbeat_to_pb(report))
        return wire.heartbeat_reply_from_pb(response)

    def join_rendezvous(self, request: api.JoinRequest) -> int:
        """Join the next rendezvous round (JoinRendezvous RPC); returns its number."""
        return self.call(self.stub.JoinRendezvous, wire.join_to_pb(request)).round

    def get_comm_world(self, node_id: str, round: int, wait_s: float = 0.0) -> api.CommWorld:
        """This node's world (GetCommWorld RPC); ``complete`` is False until its round closes.
        ``wait_s`` > 0: one long poll (the master holds it until the round closes, at most
        MAX_LONG_POLL_S)."""
        request = pb.GetCommWorldRequest(node_id=node_id, round=round, wait_s=wait_s)
        return wire.world_from_pb(self.call(self.stub.GetCommWorld, request, self._held(wait_s)))

    def num_nodes_waiting(self, node_id: str, round: int, wait_s: float = 0.0) -> api.Waiting:
        """Waiting nodes that should make the world re-form, and the newest round (NumNodesWaiting
        RPC); ``wait_s`` > 0 makes it one membership watch (a long poll)."""
        request = pb.NumNodesWaitingRequest(node_id=node_id, round=round, wait_s=wait_s)
        response = self.call(self.stub.NumNodesWaiting, request, self._held(wait_s))
        return api.Waiting(response.waiting, response.latest_round, response.job_ended)

    def report_node_status(self, report: api.NodeReport, wait_s: float = 0.0) -> bool:
        """Report how this node's workers finished (ReportNodeStatus RPC); True once the whole job
        has succeeded. ``wait_s`` > 0 holds the call until the job ended (a long poll)."""
        request = wire.node_report_to_pb(report)
        request.wait_s = wait_s
        return self.call(self.stub.ReportNodeStatus, request, self._held(wait_s)).job_done

    def join_node_check(self, join: api.NodeCheckJoin, wait_s: float = 0.0) -> api.NodeCheckTask:
        """Join a node-check round (JoinNodeCheck RPC); ``wait_s`` > 0 holds the call until every
        member joined it or the verdict is out (a long poll)."""
        request = wire.check_join_to_pb(join, wait_s)
        return wire.check_task_from_pb(
            self.call(self.stub.JoinNodeCheck, request, self._held(wait_s))
        )

    def report_node_check(self, report: api.NodeCheckReport) -> None:
        """Report this node's result of a node-check round (ReportNodeCheck RPC)."""
        self.call(self.stub.ReportNodeCheck, wire.check_report_to_pb(report))

    def report_failure(self, node_id: str, incarnation: int, record: api.FailureRecord) -> None:
        """Record a classified failure of this node (ReportFailure RPC)."""
        request = pb.ReportFailureRequest(
            node_id=node_id, incarnation=incarnation, record=wire.failure_to_pb(record)
        )
        self.call(self.stub.ReportFailure, request)

    def get_failures(self) -> tuple[api.FailureRecord, ...]:
        """Every failure the job recorded, oldest first (GetFailures RPC)."""
        response = self.call(self.stub.GetFailures, pb.GetFailuresRequest())
        return tuple(wire.failure_from_pb(f) for f in response.failures)

    def get_job_status(self, with_nodes: bool = True) -> api.JobStatus:
        """The job and (``with_nodes``) its nodes as the master sees them (GetJobStatus RPC)."""
        request = pb.GetJobStatusRequest(without_nodes=not with_nodes)
        return wire.job_status_from_pb(self.call(self.stub.GetJobStatus, request))

    def _held(self, wait_s: float) -> float:
        """The deadline of a long poll: what the master may hold it, plus the usual RPC time."""
        return min(max(0.0, wait_s), MAX_LONG_POLL_S) + self._timeout

    def stop_job(self, reason: str) -> api.JobStatus:
        """End the job as failed with ``reason`` (StopJob RPC); returns its status."""
        request = pb.StopJobRequest(reason=reason)
        return wire.job_status_from_pb(self.call(self.stub.StopJob, request))

    def scale_role(self, role: str, count: int) -> tuple[str, int]:
        """Ask for ``count`` nodes of ``role`` (ScaleRole RPC): what the master will do, and the
        id of the request, which its report carries."""
        request = pb.ScaleRoleRequest(role=role, count=count)
        response = self.call(self.stub.ScaleRole, request)
        return str(response.message), int(response.request_id)

    # --- key-value -----------------------------------------------------------------------------
    def kv_set(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` (KvSet RPC)."""
        self.call(self.stub.KvSet, pb.KvSetRequest(key=key, value=value))

    def kv_get(self, key: str, wait_s: float = 0.0) -> bytes | None:
        """The value of ``key``, asking again until ``wait_s`` seconds have passed (the master holds
        each KvGet at most MAX_KV_WAIT_S); None if it never appeared."""
        deadline = time.monotonic() + wait_s
        while True:
            left = max(0.0, deadline - time.monotonic())
            resp = self.call(
                self.stub.KvGet, pb.KvGetRequest(key=key, wait_s=left), left + self._timeout
            )
            if resp.found:
                return bytes(resp.value)
            if time.monotonic() >= deadline:
                return None

    # --- training-process calls ----------------------------------------------------------------
    def report_step(
        self,
        step: int,
        rank: int | None = None,
        metrics: dict[str, float] | None = None,
        node_id: str | None = None,
    ) -> None:
        """Tell the master the training step this process has completed."""
        self.call(
            self.stub.ReportStep,
            pb.ReportStepRequest(
                node_id=node_id or os.environ.get(ENV_NODE_ID, ""),
                rank=WorkerContext.from_env().rank if rank is None else rank,
                step=step,
                timestamp=time.time(),
                metrics=metrics or {},
            ),
        )

    # --- flash-checkpoint votes ----------------------------------------------------------------
    def checkpoint_persisted(self, step: int, node_rank: int, total_nodes: int) -> bool:
        """Report that this node persisted all its files of ``step`` (CheckpointPersisted RPC); True
        if it is the step's committer."""
        request = pb.CheckpointPersistedRequest(
            step=step, node_rank=node_rank, total_nodes=total_nodes
        )
        return bool(self.call(self.stub.CheckpointPersisted, request).committer)

    def checkpoint_committed(self, step: int) -> None:
        """Mark ``step`` committed (CheckpointCommitted RPC with ``mark`` set)."""
        self.call(
            self.stub.CheckpointCommitted, pb.CheckpointCommittedRequest(step=step, mark=True)
        )

    def wait_checkpoint_committed(self, step: int, wait_s: float) -> bool:
        """Whether ``step`` is committed within ``wait_s`` (asking again every few seconds)."""
        deadline = time.monotonic() + wait_s
        while True:
            wait = min(CHECKPOINT_WAIT_S, max(0.0, deadline - time.monotonic()))
            request = pb.CheckpointCommittedRequest(step=step, wait_s=wait)
            if self.call(self.stub.CheckpointCommitted, request, wait + self._timeout).committed:
                return True
            if time.monotonic() >= deadline:
                return False

    def vote_load_step(
        self, node_rank: int, total_nodes: int, local_step: int | None, round_id: int, wait_s: float
    ) -> tuple[bool, int | None]:
        """Vote, then ask until the round is decided or ``wait_s`` has passed."""
        deadline = time.monotonic() + wait_s
        while True:
            wait = min(CHECKPOINT_WAIT_S, max(0.0, deadline - time.monotonic()))
            request = pb.AgreeLoadStepRequest(
                node_rank=node_rank, total_nodes=total_nodes, round_id=round_id, wait_s=wait
            )
            if local_step is not None:
                request.local_step = local_step
            response = self.call(self.stub.AgreeLoadStep, request, wait + self._timeout)
            if response.decided:
                return True, response.step if response.HasField("step") else None
            if time.monotonic() >= deadline:
                return False, None
