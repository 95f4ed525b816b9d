"""The master's gRPC service: token check, message caps, and proto <-> JobMaster translation.

It is an asyncio server (grpc.aio) on a loop thread of its own: a long poll held for one of
10,000 nodes is a suspended coroutine, not a thread. Handlers that answer at once call the
JobMaster inline (its methods are quick and thread-safe); the waits that block a thread inside
the JobMaster (key-value and checkpoint waits) run on a small thread pool.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent import futures
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from dlrover.api import wire
from dlrover.api.errors import MasterRequestError, UnknownNodeError
from dlrover.constants import MAX_MESSAGE_BYTES, TOKEN_METADATA_KEY
from dlrover.master.changes import ChangeFeed
from dlrover.master.fencing import Fence, Leader
from dlrover.master.job import JobMaster
from dlrover.master.kv_store import KvError
from dlrover.master.local_api import LocalMasterApi, LongPoll, hold_s
from dlrover.master.nodes import NodeError
from dlrover.master.rendezvous import RendezvousError
from dlrover.proto import master_pb2 as pb
from dlrover.proto import master_pb2_grpc as pb_grpc
from dlrover.sharding import wire as sharding_wire
from dlrover.sharding.errors import ShardingError

logger = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R", bound=Message)

FULL_GC_EVERY_S = 600.0
"""How often a master that owns its process runs a full garbage collection (see MasterServer)."""

_NEVER = 2**30
"""A generation-2 threshold that is never reached."""

_MAX_PENDING_CALLS = 100_000
"""Calls that may queue in gRPC before the loop takes them (a 10,000-node job's burst, x10)."""

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


class _TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose metadata lacks the job's token."""

    def __init__(self, token: str) -> None:
        self._token = token

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "wrong or missing job token: set DLROVER_JOB_TOKEN to the token the master printed",
            )

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        for key, value in handler_call_details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY and secrets.compare_digest(str(value), self._token):
                return await continuation(handler_call_details)
        return self._deny


def _refusal(e: Exception) -> tuple[grpc.StatusCode, str] | None:
    """The status a refused request gets, or None for an error that is a bug (re-raised)."""
    if isinstance(e, UnknownNodeError):
        return grpc.StatusCode.NOT_FOUND, str(e)
    if isinstance(e, MasterRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, NodeError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(e)
    if isinstance(e, (RendezvousError, KvError, ValueError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    return None


async def _guard_async(context: grpc.aio.ServicerContext, work: Awaitable[T]) -> T:
    """Await a handler's work; a refused request becomes a clear status, never a stack trace."""
    try:
        return await work
    except Exception as e:
        refusal = _refusal(e)
        if refusal is None:
            raise
        await context.abort(*refusal)
    raise AssertionError("unreachable")


async def _guard(context: grpc.aio.ServicerContext, fn: Callable[[], T]) -> T:
    """Run a quick handler inline on the loop (see `_guard_async`)."""

    async def run() -> T:
        return fn()

    return await _guard_async(context, run())


async def _sharding(
    context: grpc.aio.ServicerContext, response: Callable[..., R], fn: Callable[[], R]
) -> R:
    """Run a sharding handler: a ShardingError travels in the response's typed `error` field
    (the client raises the same class); a malformed request is refused like any other."""

    return await _guard(context, lambda: _sharding_call(response, fn))


def _sharding_call(response: Callable[..., R], fn: Callable[[], R]) -> R:
    """``fn()``, or the response carrying the ShardingError it raised."""
    try:
        return fn()
    except ShardingError as e:
        return response(error=sharding_wire.error_to_proto(e))


class _Waker:
    """Wakes the loop's waiters on a ChangeFeed: a bump (from any thread) resolves every future
    parked on it. One future and one timer per held call: at 10,000 held calls, every object
    per call is 10,000 more for the garbage collector to walk."""

    def __init__(self, loop: asyncio.AbstractEventLoop, feed: ChangeFeed) -> None:
        self._loop = loop
        self._feed = feed
        self._parked: set[asyncio.Future[None]] = set()
        self.generation = 0
        """Bumps seen by the loop; a waiter compares it before and after it looks."""
        feed.subscribe(self._on_bump)

    def _on_bump(self) -> None:
        if not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self.generation += 1
        parked, self._parked = self._parked, set()
        for future in parked:
            if not future.done():
                future.set_result(None)

    async def wait(self, generation: int, timeout_s: float) -> None:
        """Return at the first bump after ``generation``, or after ``timeout_s``."""
        if generation != self.generation:
            return
        future = self._loop.create_future()
        self._parked.add(future)
        timer = self._loop.call_later(timeout_s, _resolve, future)
        try:
            await future
        finally:
            timer.cancel()
            self._parked.discard(future)

    def close(self) -> None:
        """Stop listening to the feed."""
        self._feed.unsubscribe(self._on_bump)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _require(request: Message, field: str) -> None:
    """Refuse (INVALID_ARGUMENT) a request that lacks a message field it cannot do without."""
    if not request.HasField(field):
        raise ValueError(f"{type(request).__name__} has no {field!r}: it is required")


class MasterServicer(pb_grpc.MasterServicer):
    """Thin adapter: converts messages (`dlrover.api.wire`) and calls `LocalMasterApi`, where
    the rules of each call live; refusals become gRPC status codes in `_guard`."""

    def __init__(
        self, job: JobMaster, loop: asyncio.AbstractEventLoop, executor: futures.Executor
    ) -> None:
        self.job = job
        self.api = LocalMasterApi(job)
        self._loop = loop
        self._executor = executor
        self._wakers = {
            id(feed): _Waker(loop, feed) for feed in (job.rounds, job.membership, job.checks)
        }

    def close(self) -> None:
        """Detach from the job's change feeds."""
        for waker in self._wakers.values():
            waker.close()

    async def _hold(self, poll: LongPoll[T], wait_s: float) -> T:
        """Run a long poll as a coroutine: at most hold_s(``wait_s``) seconds, waking when its
        feed is bumped (or its `wake_at` time comes)."""
        waker = self._wakers[id(poll.feed)]
        deadline = self._loop.time() + hold_s(wait_s)
        while True:
            generation = waker.generation  # taken before looking: no bump in between is missed
            answer = poll.check()
            if answer is not None:
                return answer
            now = self._loop.time()
            if now >= deadline:
                return poll.on_timeout()
            await waker.wait(generation, poll.sleep_s(deadline - now, self.job.now()))

    async def _blocking(self, context: grpc.aio.ServicerContext, fn: Callable[[], T]) -> T:
        """Run a handler that blocks a thread inside the JobMaster on the server's pool."""
        return await _guard_async(context, self._loop.run_in_executor(self._executor, fn))

    async def RegisterNode(
        self, request: pb.RegisterNodeRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterNodeResponse:  # noqa: N802
        """Register an agent; answer its node id, incarnation and the job's node range."""
        return await _guard(
            context,
            lambda: wire.registered_to_pb(
                self.api.register_node(wire.registration_from_pb(request))
            ),
        )

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:  # noqa: N802
        """Record an agent's heartbeat; answer what it must do and the job's state."""

        return await _guard(
            context,
            lambda: wire.heartbeat_reply_to_pb(self.api.heartbeat(wire.heartbeat_from_pb(request))),
        )

    async def JoinRendezvous(
        self, request: pb.JoinRendezvousRequest, context: grpc.aio.ServicerContext
    ) -> pb.JoinRendezvousResponse:  # noqa: N802
        """Put a node into the next rendezvous round; answer the round's number."""
        return await _guard(
            context,
            lambda: pb.JoinRendezvousResponse(
                round=self.api.join_rendezvous(wire.join_from_pb(request))
            ),
        )

    async def GetCommWorld(
        self, request: pb.GetCommWorldRequest, context: grpc.aio.ServicerContext
    ) -> pb.CommWorld:  # noqa: N802
        """Answer a node's world once its round has closed (``complete`` is False until then);
        with ``wait_s``, a long poll held until the round closes."""
        poll = self.api.comm_world_poll(request.node_id, request.round)
        world = await _guard_async(context, self._hold(poll, request.wait_s))
        return wire.world_to_pb(world)

    async def NumNodesWaiting(
        self, request: pb.NumNodesWaitingRequest, context: grpc.aio.ServicerContext
    ) -> pb.NumNodesWaitingResponse:  # noqa: N802
        """Answer how many waiting nodes should make the running world re-form, and the newest
        round."""

        poll = self.api.membership_poll(request.node_id, request.round)
        w = await _guard_async(context, self._hold(poll, request.wait_s))
        return pb.NumNodesWaitingResponse(
            waiting=w.waiting, latest_round=w.latest_round, job_ended=w.job_ended
        )

    async def KvSet(
        self, request: pb.KvSetRequest, context: grpc.aio.ServicerContext
    ) -> pb.KvSetResponse:  # noqa: N802
        """Store a value in the master's key-value store."""

        def run() -> pb.KvSetResponse:
            self.api.kv_set(request.key, request.value)
            return pb.KvSetResponse()

        return await _guard(context, run)

    async def KvGet(
        self, request: pb.KvGetRequest, context: grpc.aio.ServicerContext
    ) -> pb.KvGetResponse:  # noqa: N802
        """Answer a key's value, holding the call up to ``wait_s`` (at most MAX_KV_WAIT_S) for it to
        appear."""

        def run() -> pb.KvGetResponse:
            value = self.api.kv_get(request.key, request.wait_s)
            if value is None:
                return pb.KvGetResponse(found=False)
            return pb.KvGetResponse(found=True, value=value)

        if request.wait_s <= 0:
            return await _guard(context, run)
        return await self._blocking(context, run)

    async def ReportStep(
        self, request: pb.ReportStepRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportStepResponse:  # noqa: N802
        """Record a training step that a worker of a node finished."""

        def run() -> pb.ReportStepResponse:
            self.api.report_step(request.step, request.rank, dict(request.metrics), request.node_id)
            return pb.ReportStepResponse()

        return await _guard(context, run)

    async def ReportNodeStatus(
        self, request: pb.ReportNodeStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportNodeStatusResponse:  # noqa: N802
        """Record that a node's workers finished; answer whether the whole job has succeeded
        (with ``wait_s``, a long poll held until the job has ended: the exit barrier)."""
        poll = await _guard(context, lambda: self.api.exit_poll(wire.node_report_from_pb(request)))
        done = await _guard_async(context, self._hold(poll, request.wait_s))
        return pb.ReportNodeStatusResponse(job_done=done)

    async def JoinNodeCheck(
        self, request: pb.JoinNodeCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.NodeCheckTask:  # noqa: N802
        """Record a node ready for a node-check round; answer its task once every member joined
        the round or the verdict is out (with ``wait_s``, a long poll)."""
        join = wire.check_join_from_pb(request)
        poll = await _guard(context, lambda: self.api.node_check_poll(join))
        task = await _guard_async(context, self._hold(poll, request.wait_s))
        return wire.check_task_to_pb(task)

    async def ReportNodeCheck(
        self, request: pb.ReportNodeCheckRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportNodeCheckResponse:  # noqa: N802
        """Record a node's result of a node-check round."""

        def run() -> pb.ReportNodeCheckResponse:
            self.api.report_node_check(wire.check_report_from_pb(request))
            return pb.ReportNodeCheckResponse()

        return await _guard(context, run)

    async def ReportFailure(
        self, request: pb.ReportFailureRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportFailureResponse:  # noqa: N802
        """Record a node's classified failure."""

        def run() -> pb.ReportFailureResponse:
            record = wire.failure_from_pb(request.record)
            self.api.report_failure(request.node_id, request.incarnation, record)
            return pb.ReportFailureResponse()

        return await _guard(context, run)

    async def GetFailures(
        self, request: pb.GetFailuresRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetFailuresResponse:  # noqa: N802
        """Answer every failure the job recorded."""
        return await _guard(
            context,
            lambda: pb.GetFailuresResponse(
                failures=[wire.failure_to_pb(f) for f in self.api.get_failures()]
            ),
        )

    async def GetJobStatus(
        self, request: pb.GetJobStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.JobStatus:  # noqa: N802
        """Answer the job's state and its nodes (``dlrover status``)."""
        return await _guard(
            context,
            lambda: wire.job_status_to_pb(self.api.get_job_status(not request.without_nodes)),
        )

    async def CheckpointPersisted(
        self, request: pb.CheckpointPersistedRequest, context: grpc.aio.ServicerContext
    ) -> pb.CheckpointPersistedResponse:  # noqa: N802
        """Record that a node persisted a checkpoint step; answer whether it is that step's
        committer."""
        return await _guard(
            context,
            lambda: pb.CheckpointPersistedResponse(
                committer=self.api.checkpoint_persisted(
                    request.step, request.node_rank, request.total_nodes
                )
            ),
        )

    async def CheckpointCommitted(
        self, request: pb.CheckpointCommittedRequest, context: grpc.aio.ServicerContext
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

        return await self._blocking(context, run)

    async def AgreeLoadStep(
        self, request: pb.AgreeLoadStepRequest, context: grpc.aio.ServicerContext
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

        return await self._blocking(context, run)

    async def StopJob(
        self, request: pb.StopJobRequest, context: grpc.aio.ServicerContext
    ) -> pb.JobStatus:  # noqa: N802
        """End the job as failed with the given reason; answer its status."""
        return await _guard(
            context, lambda: wire.job_status_to_pb(self.api.stop_job(request.reason))
        )

    async def ScaleRole(
        self, request: pb.ScaleRoleRequest, context: grpc.aio.ServicerContext
    ) -> pb.ScaleRoleResponse:  # noqa: N802
        """Ask for a number of nodes of a role (the embedding servers); answer what happens."""

        def run() -> pb.ScaleRoleResponse:
            message, request_id = self.api.scale_role(request.role, request.count)
            return pb.ScaleRoleResponse(message=message, request_id=request_id)

        return await _guard(context, run)

    # --- dynamic data sharding: messages <-> dataclasses in dlrover/sharding/wire.py -----------
    async def RegisterDataset(
        self, request: pb.RegisterDatasetRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterDatasetResponse:  # noqa: N802
        """Register a dataset for dynamic sharding (the same spec again is a no-op)."""

        def run() -> pb.RegisterDatasetResponse:
            _require(request, "spec")
            result = self.job.sharding.register_dataset(
                sharding_wire.dataset_spec_from_proto(request.spec)
            )
            return pb.RegisterDatasetResponse(result=sharding_wire.register_result_to_proto(result))

        return await _sharding(context, pb.RegisterDatasetResponse, run)

    async def FetchShards(
        self, request: pb.FetchShardsRequest, context: grpc.aio.ServicerContext
    ) -> pb.FetchShardsResponse:  # noqa: N802
        """Lease a dataset's next shards to a worker."""

        def run() -> pb.FetchShardsResponse:
            result = self.job.sharding.fetch_shards(
                request.dataset, request.worker_id, request.max_count
            )
            return pb.FetchShardsResponse(result=sharding_wire.fetch_result_to_proto(result))

        return await _sharding(context, pb.FetchShardsResponse, run)

    async def ReportDone(
        self, request: pb.ReportDoneRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportDoneResponse:  # noqa: N802
        """Record shards a worker has finished."""

        def run() -> pb.ReportDoneResponse:
            shard_ids = [sharding_wire.shard_id_from_proto(s) for s in request.shard_ids]
            result = self.job.sharding.report_done(request.dataset, request.worker_id, shard_ids)
            return pb.ReportDoneResponse(result=sharding_wire.report_result_to_proto(result))

        return await _sharding(context, pb.ReportDoneResponse, run)

    async def ReportProgress(
        self, request: pb.ReportProgressRequest, context: grpc.aio.ServicerContext
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

        return await _sharding(context, pb.ReportProgressResponse, run)

    async def RenewLeases(
        self, request: pb.RenewLeasesRequest, context: grpc.aio.ServicerContext
    ) -> pb.RenewLeasesResponse:  # noqa: N802
        """Extend every lease a worker holds on a dataset."""

        def run() -> pb.RenewLeasesResponse:
            renewed = self.job.sharding.renew_leases(request.dataset, request.worker_id)
            return pb.RenewLeasesResponse(renewed=renewed)

        return await _sharding(context, pb.RenewLeasesResponse, run)

    async def GetPosition(
        self, request: pb.GetPositionRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetPositionResponse:  # noqa: N802
        """Answer a dataset's consumed position, to save with a checkpoint."""

        def run() -> pb.GetPositionResponse:
            position = self.job.sharding.get_position(request.dataset)
            return pb.GetPositionResponse(position=sharding_wire.position_to_proto(position))

        return await _sharding(context, pb.GetPositionResponse, run)

    async def MarkConsumption(
        self, request: pb.MarkConsumptionRequest, context: grpc.aio.ServicerContext
    ) -> pb.MarkConsumptionResponse:  # noqa: N802
        """Record where a worker stands in its iteration over a dataset."""

        def run() -> pb.MarkConsumptionResponse:
            _require(request, "mark")
            mark = sharding_wire.consumption_mark_from_proto(request.mark)
            self.job.sharding.mark_consumption(request.dataset, request.worker_id, mark)
            return pb.MarkConsumptionResponse()

        return await _sharding(context, pb.MarkConsumptionResponse, run)

    async def PositionAt(
        self, request: pb.PositionAtRequest, context: grpc.aio.ServicerContext
    ) -> pb.PositionAtResponse:  # noqa: N802
        """Answer a dataset's position at a step of every worker, or the workers it still waits
        for."""

        def run() -> pb.PositionAtResponse:
            result = self.job.sharding.position_at(request.dataset, request.epoch, request.consumed)
            return pb.PositionAtResponse(result=sharding_wire.position_at_to_proto(result))

        return await _sharding(context, pb.PositionAtResponse, run)

    async def RestorePosition(
        self, request: pb.RestorePositionRequest, context: grpc.aio.ServicerContext
    ) -> pb.RestorePositionResponse:  # noqa: N802
        """Reset a dataset's queues to a checkpointed position (once per restore token)."""

        def run() -> pb.RestorePositionResponse:
            _require(request, "position")
            token = request.token if request.HasField("token") else None
            applied = self.job.sharding.restore_position(
                sharding_wire.position_from_proto(request.position), token
            )
            return pb.RestorePositionResponse(applied=applied)

        return await _sharding(context, pb.RestorePositionResponse, run)

    async def DatasetProgress(
        self, request: pb.DatasetProgressRequest, context: grpc.aio.ServicerContext
    ) -> pb.DatasetProgressResponse:  # noqa: N802
        """Answer a dataset's progress counters."""

        def run() -> pb.DatasetProgressResponse:
            progress = self.job.sharding.dataset_progress(request.dataset)
            return pb.DatasetProgressResponse(
                result=sharding_wire.dataset_progress_to_proto(progress)
            )

        return await _sharding(context, pb.DatasetProgressResponse, run)

    # --- streams: messages <-> dataclasses in dlrover/sharding/wire.py ------------------------
    async def RegisterStream(
        self, request: pb.RegisterStreamRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterStreamResponse:  # noqa: N802
        """Register a stream over the Kafka topic its spec names (the same spec again is a
        no-op). The first registration asks the broker for the partitions: off the loop."""

        def run() -> pb.RegisterStreamResponse:
            _require(request, "spec")
            spec = sharding_wire.stream_spec_from_proto(request.spec)
            result = self.job.sharding.register_stream(spec)
            return pb.RegisterStreamResponse(result=sharding_wire.register_result_to_proto(result))

        return await self._blocking(context, lambda: _sharding_call(pb.RegisterStreamResponse, run))

    async def FetchStreamShards(
        self, request: pb.FetchStreamShardsRequest, context: grpc.aio.ServicerContext
    ) -> pb.FetchStreamShardsResponse:  # noqa: N802
        """Lease a stream's next record ranges to a worker."""

        def run() -> pb.FetchStreamShardsResponse:
            result = self.job.sharding.fetch_stream_shards(
                request.stream, request.worker_id, request.max_count
            )
            return pb.FetchStreamShardsResponse(
                result=sharding_wire.stream_fetch_result_to_proto(result)
            )

        return await _sharding(context, pb.FetchStreamShardsResponse, run)

    async def ReportStreamDone(
        self, request: pb.ReportStreamDoneRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportStreamDoneResponse:  # noqa: N802
        """Record record ranges a worker has finished."""

        def run() -> pb.ReportStreamDoneResponse:
            keys = [(r.partition, r.start) for r in request.shards]
            accepted = self.job.sharding.report_stream_done(request.stream, request.worker_id, keys)
            return pb.ReportStreamDoneResponse(accepted=accepted)

        return await _sharding(context, pb.ReportStreamDoneResponse, run)

    async def ReturnStreamShards(
        self, request: pb.ReturnStreamShardsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReportStreamDoneResponse:  # noqa: N802
        """Take back record ranges a worker will not read further (its pass closed early)."""

        def run() -> pb.ReportStreamDoneResponse:
            remainders = [(r.partition, r.start, r.resume, r.yielded) for r in request.shards]
            accepted = self.job.sharding.return_stream_shards(
                request.stream, request.worker_id, remainders
            )
            return pb.ReportStreamDoneResponse(accepted=accepted)

        return await _sharding(context, pb.ReportStreamDoneResponse, run)

    async def RenewStreamLeases(
        self, request: pb.RenewLeasesRequest, context: grpc.aio.ServicerContext
    ) -> pb.RenewLeasesResponse:  # noqa: N802
        """Extend every lease a worker holds on a stream (`dataset` names the stream)."""

        def run() -> pb.RenewLeasesResponse:
            renewed = self.job.sharding.renew_stream_leases(request.dataset, request.worker_id)
            return pb.RenewLeasesResponse(renewed=renewed)

        return await _sharding(context, pb.RenewLeasesResponse, run)

    async def MarkStream(
        self, request: pb.MarkStreamRequest, context: grpc.aio.ServicerContext
    ) -> pb.MarkStreamResponse:  # noqa: N802
        """Record where a worker stands in its pass over a stream; refused for a range it no
        longer holds."""

        def run() -> pb.MarkStreamResponse:
            _require(request, "mark")
            mark = sharding_wire.stream_mark_from_proto(request.mark)
            accepted = self.job.sharding.mark_stream(request.stream, request.worker_id, mark)
            return pb.MarkStreamResponse(accepted=accepted)

        return await _sharding(context, pb.MarkStreamResponse, run)

    async def StreamPositionAt(
        self, request: pb.StreamPositionAtRequest, context: grpc.aio.ServicerContext
    ) -> pb.StreamPositionAtResponse:  # noqa: N802
        """Answer a stream's position once every worker yielded a number of records, or the
        workers it still waits for."""

        def run() -> pb.StreamPositionAtResponse:
            result = self.job.sharding.stream_position_at(request.stream, request.consumed)
            return pb.StreamPositionAtResponse(
                result=sharding_wire.stream_position_at_to_proto(result)
            )

        return await _sharding(context, pb.StreamPositionAtResponse, run)

    async def RestoreStreamPosition(
        self, request: pb.RestoreStreamPositionRequest, context: grpc.aio.ServicerContext
    ) -> pb.RestorePositionResponse:  # noqa: N802
        """Restart a stream at a checkpointed position (once per restore token)."""

        def run() -> pb.RestorePositionResponse:
            _require(request, "position")
            token = request.token if request.HasField("token") else None
            applied = self.job.sharding.restore_stream(
                sharding_wire.stream_position_from_proto(request.position), token
            )
            return pb.RestorePositionResponse(applied=applied)

        return await _sharding(context, pb.RestorePositionResponse, run)

    async def StopStream(
        self, request: pb.StreamProgressRequest, context: grpc.aio.ServicerContext
    ) -> pb.StreamProgressResponse:  # noqa: N802
        """Cut no new shards of a stream: it ends once the ranges in flight are done."""

        def run() -> pb.StreamProgressResponse:
            progress = self.job.sharding.stop_stream(request.stream)
            return pb.StreamProgressResponse(
                result=sharding_wire.stream_progress_to_proto(progress)
            )

        return await _sharding(context, pb.StreamProgressResponse, run)

    async def StreamProgress(
        self, request: pb.StreamProgressRequest, context: grpc.aio.ServicerContext
    ) -> pb.StreamProgressResponse:  # noqa: N802
        """Answer a stream's counters: committed and end offsets per partition."""

        def run() -> pb.StreamProgressResponse:
            progress = self.job.sharding.stream_progress(request.stream)
            return pb.StreamProgressResponse(
                result=sharding_wire.stream_progress_to_proto(progress)
            )

        return await _sharding(context, pb.StreamProgressResponse, run)


class MasterServer:
    """Serves a JobMaster over gRPC (asyncio, on a loop thread of its own) and drives its
    `tick()` from one background thread, early when a rendezvous round's last call ends.

    ``full_gc_every_s`` > 0 (a master in a process of its own): Python's automatic full
    collections are turned off and one runs every that many seconds from the tick thread
    instead. With 10,000 held calls the heap has ~10^6 objects and an automatic full collection
    (every few seconds, as held calls come and go) stops every call for 0.3-0.7 s; the young
    generations are still collected as usual.
    """

    def __init__(
        self,
        job: JobMaster,
        token: str,
        host: str = "0.0.0.0",
        port: int = 0,
        tick_interval_s: float = 0.5,
        max_workers: int = 32,
        full_gc_every_s: float = 0.0,
        fence: Fence | None = None,
        on_fenced: Callable[[Leader], None] | None = None,
    ) -> None:
        self.job = job
        self._fence = fence
        self._on_fenced = on_fenced
        self.fenced = threading.Event()
        """Set when another master took over the job's state: this one stopped serving."""
        self.fenced_by: Leader | None = None
        self._full_gc_every_s = full_gc_every_s
        self.token = token
        self.host = host
        self._tick_interval_s = tick_interval_s
        self._stop = threading.Event()
        self._executor = futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="dlrover-master-wait"
        )
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self._loop.run_forever, name="dlrover-master-grpc", daemon=True
        )
        self._loop_thread.start()
        self._servicer: MasterServicer | None = None
        try:
            self.port = self._run(self._bind(host, port), 30.0)
        except BaseException:
            self._shutdown_loop()
            raise
        self._ticker = threading.Thread(
            target=self._tick_loop, name="dlrover-master-tick", daemon=True
        )

    def _run(self, work: Awaitable[T], timeout_s: float) -> T:
        async def wrap() -> T:
            return await work

        return asyncio.run_coroutine_threadsafe(wrap(), self._loop).result(timeout_s)

    async def _bind(self, host: str, port: int) -> int:
        self._server = grpc.aio.server(
            interceptors=[_TokenInterceptor(self.token)],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                # Without this two masters could silently share one port.
                ("grpc.so_reuseport", 0),
                # gRPC cancels calls that arrive faster than the loop takes them once about
                # 1,000 wait (its default): 10,000 nodes registering at once would lose most.
                ("grpc.server.max_pending_requests", _MAX_PENDING_CALLS),
                ("grpc.server.max_pending_requests_hard_limit", _MAX_PENDING_CALLS),
            ],
        )
        self._servicer = MasterServicer(self.job, self._loop, self._executor)
        pb_grpc.add_MasterServicer_to_server(self._servicer, self._server)
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
        return bound

    def start(self) -> MasterServer:
        """Start serving and the tick thread; returns self."""
        self._run(self._server.start(), 30.0)
        if self._full_gc_every_s > 0:
            gen0, gen1, _ = gc.get_threshold()
            gc.set_threshold(gen0, gen1, _NEVER)
        self._ticker.start()
        logger.info(
            "master of job %s listening on %s:%d", self.job.config.job_name, self.host, self.port
        )
        return self

    def _tick_loop(self) -> None:
        next_gc = time.monotonic() + self._full_gc_every_s
        while True:
            wait = self._tick_interval_s
            deadline = self.job.close_deadline()
            if deadline is not None:
                wait = min(wait, max(0.01, deadline - self.job.now()))
            if self._stop.wait(wait):
                return
            newer = self._fence.superseded() if self._fence is not None else None
            if newer is not None:
                self._step_down(newer)
                return
            try:
                self.job.tick()
            except Exception:  # the loop must outlive one bad tick
                logger.exception("master tick failed")
            if self._full_gc_every_s > 0 and time.monotonic() >= next_gc:
                start = time.monotonic()
                found = gc.collect()
                next_gc = time.monotonic() + self._full_gc_every_s
                logger.debug("full collection: %d objects in %.3fs", found, next_gc - start)

    def _step_down(self, newer: Leader) -> None:
        """Another master claimed the state: stop serving at once, write nothing more."""
        logger.error(
            "another master (%s) took over the state of job %s; this one (epoch %d) stops "
            "serving and leaves the job to it",
            newer.describe(),
            self.job.config.job_name,
            self._fence.leader.epoch if self._fence else 0,
        )
        self.fenced_by = newer
        self.fenced.set()
        try:
            self._run(self._server.stop(0), 2.0)
        except (futures.TimeoutError, RuntimeError):
            pass
        if self._on_fenced is not None:
            self._on_fenced(newer)

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop ticking and serving: in-flight calls get ``grace_s`` seconds, and the wait for the
        server and the tick thread is bounded (about ``grace_s`` + 1 s and a tick interval + 1
        s)."""
        self._stop.set()
        if not self._loop.is_closed():
            try:
                self._run(self._server.stop(grace_s), grace_s + 1.0)
            except (futures.TimeoutError, RuntimeError):
                logger.warning("the master's server did not stop within %.1fs", grace_s + 1.0)
        self._shutdown_loop()
        if self._ticker.is_alive():
            self._ticker.join(timeout=self._tick_interval_s + 1.0)
        self.job.sharding.close()

    def _shutdown_loop(self) -> None:
        if self._servicer is not None:
            self._servicer.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=5.0)
        if not self._loop_thread.is_alive():
            self._loop.close()
