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
from dlrover.sharding.errors import ShardingError

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_CHECKPOINT_WAIT_S = 10.0
"""A checkpoint wait held in the master is capped; clients ask again until their own deadline."""


class MasterServerError(Exception):
    """The master's server could not start (e.g. the port is taken)."""


def new_token() -> str:
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
    except ShardingError as e:
        # The class name travels so the client re-raises the same typed error.
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{type(e).__name__}: {e}")
    except (RendezvousError, KvError, ValueError) as e:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
    raise AssertionError("unreachable")


class MasterServicer(pb_grpc.MasterServicer):
    """Thin adapter: converts messages (`dlrover.api.wire`) and calls `LocalMasterApi`, where
    the rules of each call live; refusals become gRPC status codes in `_guard`."""

    def __init__(self, job: JobMaster) -> None:
        self.job = job
        self.api = LocalMasterApi(job)

    def RegisterNode(
        self, request: pb.RegisterNodeRequest, context: grpc.ServicerContext
    ) -> pb.RegisterNodeResponse:  # noqa: N802
        return _guard(
            context,
            lambda: wire.registered_to_pb(
                self.api.register_node(wire.registration_from_pb(request))
            ),
        )

    def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> pb.HeartbeatResponse:  # noqa: N802
        def run() -> pb.HeartbeatResponse:
            reply = self.api.heartbeat(wire.heartbeat_from_pb(request))
            return pb.HeartbeatResponse(action=reply.action.value, job_state=reply.job_state)

        return _guard(context, run)

    def JoinRendezvous(
        self, request: pb.JoinRendezvousRequest, context: grpc.ServicerContext
    ) -> pb.JoinRendezvousResponse:  # noqa: N802
        return _guard(
            context,
            lambda: pb.JoinRendezvousResponse(
                round=self.api.join_rendezvous(wire.join_from_pb(request))
            ),
        )

    def GetCommWorld(
        self, request: pb.GetCommWorldRequest, context: grpc.ServicerContext
    ) -> pb.CommWorld:  # noqa: N802
        return _guard(
            context,
            lambda: wire.world_to_pb(self.api.get_comm_world(request.node_id, request.round)),
        )

    def NumNodesWaiting(
        self, request: pb.NumNodesWaitingRequest, context: grpc.ServicerContext
    ) -> pb.NumNodesWaitingResponse:  # noqa: N802
        def run() -> pb.NumNodesWaitingResponse:
            w = self.api.num_nodes_waiting(request.node_id, request.round)
            return pb.NumNodesWaitingResponse(waiting=w.waiting, latest_round=w.latest_round)

        return _guard(context, run)

    def KvSet(self, request: pb.KvSetRequest, context: grpc.ServicerContext) -> pb.KvSetResponse:  # noqa: N802
        def run() -> pb.KvSetResponse:
            self.api.kv_set(request.key, request.value)
            return pb.KvSetResponse()

        return _guard(context, run)

    def KvGet(self, request: pb.KvGetRequest, context: grpc.ServicerContext) -> pb.KvGetResponse:  # noqa: N802
        def run() -> pb.KvGetResponse:
            value = self.api.kv_get(request.key, request.wait_s)
            if value is None:
                return pb.KvGetResponse(found=False)
            return pb.KvGetResponse(found=True, value=value)

        return _guard(context, run)

    def ReportStep(
        self, request: pb.ReportStepRequest, context: grpc.ServicerContext
    ) -> pb.ReportStepResponse:  # noqa: N802
        def run() -> pb.ReportStepResponse:
            self.api.report_step(
                request.step, request.rank, dict(request.metrics), request.node_id
            )
            return pb.ReportStepResponse()

        return _guard(context, run)

    def ReportNodeStatus(
        self, request: pb.ReportNodeStatusRequest, context: grpc.ServicerContext
    ) -> pb.ReportNodeStatusResponse:  # noqa: N802
        return _guard(
            context,
            lambda: pb.ReportNodeStatusResponse(
                job_done=self.api.report_node_status(wire.node_report_from_pb(request))
            ),
        )

    def GetJobStatus(
        self, request: pb.GetJobStatusRequest, context: grpc.ServicerContext
    ) -> pb.JobStatus:  # noqa: N802
        return _guard(context, lambda: wire.job_status_to_pb(self.api.get_job_status()))

    def CheckpointPersisted(
        self, request: pb.CheckpointPersistedRequest, context: grpc.ServicerContext
    ) -> pb.CheckpointPersistedResponse:  # noqa: N802
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
        return _guard(context, lambda: wire.job_status_to_pb(self.api.stop_job(request.reason)))

    def Sharding(
        self, request: pb.ShardingRequest, context: grpc.ServicerContext
    ) -> pb.ShardingResponse:  # noqa: N802
        return _guard(
            context,
            lambda: pb.ShardingResponse(
                result_json=self.job.sharding.call(request.method, request.args_json)
            ),
        )


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
        self._stop.set()
        self._server.stop(grace_s).wait(grace_s + 1.0)
        if self._ticker.is_alive():
            self._ticker.join(timeout=self._tick_interval_s + 1.0)
