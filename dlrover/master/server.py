"""The master's gRPC service: token check, message caps, and proto <-> JobMaster translation."""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from dlrover.api import wire
from dlrover.api.errors import MasterRequestError, UnknownNodeError
from dlrover.constants import MAX_MESSAGE_BYTES, TOKEN_METADATA_KEY
from dlrover.master.job import JobMaster
from dlrover.master.kv_store import KvError
from dlrover.master.local_api import LocalMasterApi
from dlrover.master.nodes import NodeError
from dlrover.master.rendezvous import RendezvousError
from dlrover.proto import master_pb2 as pb
from dlrover.proto import master_pb2_grpc as pb_grpc
from dlrover.sharding import wire as sharding_wire
from dlrover.sharding.errors import ShardingError

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R", bound=Message)

MAX_CHECKPOINT_WAIT_S = 10.0
"""A checkpoint wait held in the master is capped; clients ask again until their own deadline."""


class MasterServerError(Exception):
    """The master's server could not start (e.g. the port is taken)."""


def new_token() -> str:
    """A fresh random job token (URL-safe text of 24 random bytes) that every call must carry."""
    return secrets.token_urlsafe(24)


def job_name_for_token(token: str) -> str:
    """A job's name when none was given: stable for a token, so a master restarted with the
    same token (and state) keeps its name, and readable in logs (never the bare "none")."""
    return "job-" + hashlib.sha256(token.encode()).hexdigest()[:8]


class _TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose metadata lacks the job's token."""

    def __init__(self, token: str) -> None:
        self._token = token

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "wrong or missing job token: set DLROVER_JOB_TOKEN to the token the master printed",
            )

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY and secrets.compare_digest(str(value), self._token):
                return continuation(handler_call_details)
        return self._deny


def _guard(context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
    """Run a handler; a refused request becomes a clear status, never a stack trace."""
    try:
        return fn()
    except UnknownNodeError as e:
        context.abort(grpc.StatusCode.NOT_FOUND, str(e))
    except MasterRequestError as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    except NodeError as e:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
    except (RendezvousError, KvError, ValueError) as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    raise AssertionError("unreachable")


def _sharding(context: grpc.ServicerContext, response: Callable[..., R], fn: Callable[[], R]) -> R:
    """Run a sharding handler: a ShardingError travels in the response's typed `error` field
    (the client raises the same class); a malformed request is refused like any other."""

    def run() -> R:
        try:
            return fn()
        except ShardingError as e:
            return response(error=sharding_wire.error_to_proto(e))

    return _guard(context, run)


def _require(request: Message, field: str) -> None:
    """Refuse (INVALID_ARGUMENT) a request that lacks a message field it cannot do without."""
    if not request.HasField(field):
        raise ValueError(f"{type(request).__name__} has no {field!r}: it is required")


class MasterServicer(pb_grpc.MasterServicer):
    """Thin adapter: converts messages (`dlrover.api.wire`) and calls `LocalMasterApi`, where
    the rules of each call live; refusals become gRPC status codes in `_guard`."""

    def __init__(self, job: JobMaster) -> None:
        self.job = job
        self.api = LocalMasterApi(job)

    def RegisterNode(
        self, request: pb.RegisterNodeRequest, context: grpc.ServicerContext
    ) -> pb.RegisterNodeResponse:  # noqa: N802
        """Register an agent; answer its node id, incarnation and the job's node range."""
        return _guard(
            context,
            lambda: wire.registered_to_pb(
                self.api.register_node(wire.registration_from_pb(request))
            ),
        )

    def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.HeartbeatResponse:  # noqa: N802
        """Record an agent's heartbeat; answer what it must do and the job's state."""

        def run() -> pb.HeartbeatResponse:
            reply = self.api.heartbeat(wire.heartbeat_from_pb(request))
            return pb.HeartbeatResponse(action=reply.action.value, job_state=reply.job_state)

        return _guard(context, run)

    def JoinRendezvous(
        self, request: pb.JoinRendezvousRequest, context: grpc.ServicerContext
    ) -> pb.JoinRendezvousResponse:  # noqa: N802
        """Put a node into the next rendezvous round; answer the round's number."""
        return _guard(
            context,
            lambda: pb.JoinRendezvousResponse(
                round=self.api.join_rendezvous(wire.join_from_pb(request))
            ),
        )

    def GetCommWorld(
        self, request: pb.GetCommWorldRequest, context: grpc.ServicerContext
    ) -> pb.CommWorld:  # noqa: N802
        """Answer a node's world once its round has closed (``complete`` is False until then)."""
        return _guard(
            context,
            lambda: wire.world_to_pb(self.api.get_comm_world(request.node_id, request.round)),
        )

    def NumNodesWaiting(
        self, request: pb.NumNodesWaitingRequest, context: grpc.ServicerContext
    ) -> pb.NumNodesWaitingResponse:  # noqa: N802
        """Answer how many waiting nodes should make the running world re-form, and the newest
        round."""

        def run() -> pb.NumNodesWaitingResponse:
            w = self.api.num_nodes_waiting(request.node_id, request.round)
            return pb.NumNodesWaitingResponse(waiting=w.waiting, latest_round=w.latest_round)

        return _guard(context, run)

    def KvSet(self, request: pb.KvSetRequest, context: grpc.ServicerContext) -> pb.KvSetResponse:  # noqa: N802
        """Store a value in the master's key-value store."""

        def run() -> pb.KvSetResponse:
            self.api.kv_set(request.key, request.value)
            return pb.KvSetResponse()

        return _guard(context, run)

    def KvGet(self, request: pb.KvGetRequest, context: grpc.ServicerContext) -> pb.KvGetResponse:  # noqa: N802
        """Answer a key's value, holding the call up to ``wait_s`` (at most MAX_KV_WAIT_S) for it to
        appear."""

        def run() -> pb.KvGetResponse:
            value = self.api.kv_get(request.key, request.wait_s)
            if value is None:
                return pb.KvGetResponse(found=False)
            return pb.KvGetResponse(found=True, value=value)

        return _guard(context, run)

    def ReportStep(
        self, request: pb.ReportStepRequest, context: grpc.ServicerContext
    ) -> pb.ReportStepResponse:  # noqa: N802
        """Record a training step that a worker of a node finished."""

        def run() -> pb.ReportStepResponse:
            self.api.report_step(
                request.step, request.rank, dict(request.metrics), request.node_id
            )
            return pb.ReportStepResponse()

        return _guard(context, run)

    def ReportNodeStatus(
        self, request: pb.ReportNodeStatusRequest, context: grpc.ServicerContext
    ) -> pb.ReportNodeStatusResponse:  # noqa: N802
        """Record that a node's workers finished; answer whether the whole job has succeeded."""
        return _guard(
            context,
            lambda: pb.ReportNodeStatusResponse(
                job_done=self.api.report_node_status(wire.node_report_from_pb(request))
            ),
        )

    def GetJobStatus(
        self, request: pb.GetJobStatusRequest, context: grpc.ServicerContext
    ) -> pb.JobStatus:  # noqa: N802
        """Answer the job's state and its nodes (``dlrover status``)."""
        return _guard(context, lambda: wire.job_status_to_pb(self.api.get_job_status()))

    def CheckpointPersisted(
        self, request: pb.CheckpointPersistedRequest, context: grpc.ServicerContext
    ) -> pb.CheckpointPersistedResponse:  # noqa: N802
        """Record that a node persisted a checkpoint step; answer whether it is that step's
        committer."""
        return _guard(
            context,
            lambda: pb.CheckpointPersistedResponse(
                committer=self.api.checkpoint_persisted(
                    request.step, request.node_rank, request.total_nodes
                )
            ),
        )

    def CheckpointCommitted(
        self, request: pb.CheckpointCommittedRequest, context: grpc.ServicerContext
    ) -> pb.CheckpointCommittedResponse:  # noqa: N802
        """Mark a checkpoint step committed, or wait (at most MAX_CHECKPOINT_WAIT_S) until it is."""

        def run() -> pb.CheckpointCommittedResponse:
            if request.mark:
                self.api.checkpoint_committed(request.step)
                return pb.CheckpointCommittedResponse(committed=True)
            wait_s = min(request.wait_s, MAX_CHECKPOINT_WAIT_S)
            return pb.CheckpointCommittedResponse(
                committed=self.api.wait_checkpoint_committed(request.step, wait_s)
            )

        return _guard(context, run)

    def AgreeLoadStep(
        self, request: pb.AgreeLoadStepRequest, context: grpc.ServicerContext
    ) -> pb.AgreeLoadStepResponse:  # noqa: N802
        """Record a node's vote on the step to load; answer the decision once every node voted
        (waits at most MAX_CHECKPOINT_WAIT_S)."""

        def run() -> pb.AgreeLoadStepResponse:
            local = request.local_step if request.HasField("local_step") else None
            decided, step = self.api.vote_load_step(
                request.node_rank,
                request.total_nodes,
                local,
                request.round_id,
                min(request.wait_s, MAX_CHECKPOINT_WAIT_S),
            )
            response = pb.AgreeLoadStepResponse(decided=decided)
            if step is not None:
                response.step = step
            return response

        return _guard(context, run)

    def StopJob(self, request: pb.StopJobRequest, context: grpc.ServicerContext) -> pb.JobStatus:  # noqa: N802
        """End the job as failed with the given reason; answer its status."""
        return _guard(context, lambda: wire.job_status_to_pb(self.api.stop_job(request.reason)))

    # --- dynamic data sharding: messages <-> dataclasses in dlrover/sharding/wire.py -----------
    def RegisterDataset(
        self, request: pb.RegisterDatasetRequest, context: grpc.ServicerContext
    ) -> pb.RegisterDatasetResponse:  # noqa: N802
        """Register a dataset for dynamic sharding (the same spec again is a no-op)."""

        def run() -> pb.RegisterDatasetResponse:
            _require(request, "spec")
            result = self.job.sharding.register_dataset(sharding_wire.dataset_spec_from_proto(request.spec))
            return pb.RegisterDatasetResponse(result=sharding_wire.register_result_to_proto(result))

        return _sharding(context, pb.RegisterDatasetResponse, run)

    def FetchShards(
        self, request: pb.FetchShardsRequest, context: grpc.ServicerContext
    ) -> pb.FetchShardsResponse:  # noqa: N802
        """Lease a dataset's next shards to a worker."""

        def run() -> pb.FetchShardsResponse:
            result = self.job.sharding.fetch_shards(
                request.dataset, request.worker_id, request.max_count
            )
            return pb.FetchShardsResponse(result=sharding_wire.fetch_result_to_proto(result))

        return _sharding(context, pb.FetchShardsResponse, run)

    def ReportDone(
        self, request: pb.ReportDoneRequest, context: grpc.ServicerContext
    ) -> pb.ReportDoneResponse:  # noqa: N802
        """Record shards a worker has finished."""

        def run() -> pb.ReportDoneResponse:
            shard_ids = [sharding_wire.shard_id_from_proto(s) for s in request.shard_ids]
            result = self.job.sharding.report_done(request.dataset, request.worker_id, shard_ids)
            return pb.ReportDoneResponse(result=sharding_wire.report_result_to_proto(result))

        return _sharding(context, pb.ReportDoneResponse, run)

    def ReportProgress(
        self, request: pb.ReportProgressRequest, context: grpc.ServicerContext
    ) -> pb.ReportProgressResponse:  # noqa: N802
        """Record how far a worker is into a shard, renewing its lease."""

        def run() -> pb.ReportProgressResponse:
            _require(request, "shard_id")
            accepted = self.job.sharding.report_progress(
                request.dataset,
                request.worker_id,
                sharding_wire.shard_id_from_proto(request.shard_id),
                request.consumed,
            )
            return pb.ReportProgressResponse(accepted=accepted)

        return _sharding(context, pb.ReportProgressResponse, run)

    def RenewLeases(
        self, request: pb.RenewLeasesRequest, context: grpc.ServicerContext
    ) -> pb.RenewLeasesResponse:  # noqa: N802
        """Extend every lease a worker holds on a dataset."""

        def run() -> pb.RenewLeasesResponse:
            renewed = self.job.sharding.renew_leases(request.dataset, request.worker_id)
            return pb.RenewLeasesResponse(renewed=renewed)

        return _sharding(context, pb.RenewLeasesResponse, run)

    def GetPosition(
        self, request: pb.GetPositionRequest, context: grpc.ServicerContext
    ) -> pb.GetPositionResponse:  # noqa: N802
        """Answer a dataset's consumed position, to save with a checkpoint."""

        def run() -> pb.GetPositionResponse:
            position = self.job.sharding.get_position(request.dataset)
            return pb.GetPositionResponse(position=sharding_wire.position_to_proto(position))

        return _sharding(context, pb.GetPositionResponse, run)

    def MarkConsumption(
        self, request: pb.MarkConsumptionRequest, context: grpc.ServicerContext
    ) -> pb.MarkConsumptionResponse:  # noqa: N802
        """Record where a worker stands in its iteration over a dataset."""

        def run() -> pb.MarkConsumptionResponse:
            _require(request, "mark")
            mark = sharding_wire.consumption_mark_from_proto(request.mark)
            self.job.sharding.mark_consumption(request.dataset, request.worker_id, mark)
            return pb.MarkConsumptionResponse()

        return _sharding(context, pb.MarkConsumptionResponse, run)

    def PositionAt(
        self, request: pb.PositionAtRequest, context: grpc.ServicerContext
    ) -> pb.PositionAtResponse:  # noqa: N802
        """Answer a dataset's position at a step of every worker, or the workers it still waits
        for."""

        def run() -> pb.PositionAtResponse:
            result = self.job.sharding.position_at(request.dataset, request.epoch, request.consumed)
            return pb.PositionAtResponse(result=sharding_wire.position_at_to_proto(result))

        return _sharding(context, pb.PositionAtResponse, run)

    def RestorePosition(
        self, request: pb.RestorePositionRequest, context: grpc.ServicerContext
    ) -> pb.RestorePositionResponse:  # noqa: N802
        """Reset a dataset's queues to a checkpointed position (once per restore token)."""

        def run() -> pb.RestorePositionResponse:
            _require(request, "position")
            token = request.token if request.HasField("token") else None
            applied = self.job.sharding.restore_position(
                sharding_wire.position_from_proto(request.position), token
            )
            return pb.RestorePositionResponse(applied=applied)

        return _sharding(context, pb.RestorePositionResponse, run)

    def DatasetProgress(
        self, request: pb.DatasetProgressRequest, context: grpc.ServicerContext
    ) -> pb.DatasetProgressResponse:  # noqa: N802
        """Answer a dataset's progress counters."""

        def run() -> pb.DatasetProgressResponse:
            progress = self.job.sharding.dataset_progress(request.dataset)
            return pb.DatasetProgressResponse(result=sharding_wire.dataset_progress_to_proto(progress))

        return _sharding(context, pb.DatasetProgressResponse, run)


class MasterServer:
    """Serves a JobMaster over gRPC and drives its `tick()` from one background thread."""

    def __init__(
        self,
        job: JobMaster,
        token: str,
        host: str = "0.0.0.0",
        port: int = 0,
        tick_interval_s: float = 0.5,
        max_workers: int = 32,
    ) -> None:
        self.job = job
        self.token = token
        self._tick_interval_s = tick_interval_s
        self._stop = threading.Event()
        self._server = grpc.server(
            futures.ThreadPoolExecutor(
                max_workers=max_workers, thread_name_prefix="dlrover-master"
            ),
            interceptors=[_TokenInterceptor(token)],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                # Without this two masters could silently share one port.
                ("grpc.so_reuseport", 0),
            ],
        )
        pb_grpc.add_MasterServicer_to_server(MasterServicer(job), self._server)
        try:
            bound = self._server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as e:
            raise MasterServerError(
                f"cannot listen on {host}:{port} ({e}): the port is in use or the address is not "
                "this machine's; pick another --port, or --port 0 for a free one"
            ) from e
        if bound == 0:
            raise MasterServerError(
                f"cannot listen on {host}:{port}: the port is in use; pick another --port, "
                "or --port 0 for a free one"
            )
        self.host = host
        self.port = bound
        self._ticker = threading.Thread(
            target=self._tick_loop, name="dlrover-master-tick", daemon=True
        )

    def start(self) -> MasterServer:
        """Start serving and the tick thread; returns self."""
        self._server.start()
        self._ticker.start()
        logger.info(
            "master of job %s listening on %s:%d", self.job.config.job_name, self.host, self.port
        )
        return self

    def _tick_loop(self) -> None:
        while not self._stop.wait(self._tick_interval_s):
            try:
                self.job.tick()
            except Exception:  # the loop must outlive one bad tick
                logger.exception("master tick failed")

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop ticking and serving: in-flight calls get ``grace_s`` seconds, and the wait for the
        server and the tick thread is bounded (about ``grace_s`` + 1 s and a tick interval + 1
        s)."""
        self._stop.set()
        self._server.stop(grace_s).wait(grace_s + 1.0)
        if self._ticker.is_alive():
            self._ticker.join(timeout=self._tick_interval_s + 1.0)
