"""The master's gRPC service: token check, message caps, and the handlers derived from the API.

It is an asyncio server (grpc.aio) on a loop thread of its own: a long poll held for one of
10,000 nodes is a suspended coroutine, not a thread. Handlers that answer at once call the
JobMaster inline (its methods are quick and thread-safe); the waits that block a thread inside
the JobMaster (key-value and checkpoint waits) run on a small thread pool. Heartbeats also have
a server of their own (`HeartbeatLane`), so that no burst of other calls holds them up.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import logging
import math
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent import futures
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from dlrover.api.errors import MasterRequestError
from dlrover.api.rpc import SERVICE, Rpc, Run
from dlrover.api.wire import RPCS
from dlrover.constants import MAX_CHECKPOINT_WAIT_S, MAX_MESSAGE_BYTES, TOKEN_METADATA_KEY
from dlrover.master.changes import ChangeFeed, LongPoll, hold_s
from dlrover.master.fencing import Fence, Leader
from dlrover.master.job import JobMaster
from dlrover.master.refusals import as_refusal
from dlrover.master.sharding_service import ShardingService
from dlrover.master.state_store import StateStoreError

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["MAX_CHECKPOINT_WAIT_S", "MasterServer", "MasterServerError", "MasterServicer"]

FULL_GC_EVERY_S = 600.0
"""How often a master that owns its process runs a full garbage collection (see MasterServer)."""

_NEVER = 2**30
"""A generation-2 threshold that is never reached."""

_MAX_PENDING_CALLS = 100_000
"""Calls that may queue in gRPC before the loop takes them (a 10,000-node job's burst, x10)."""


class MasterServerError(Exception):
    """The master's server could not start (e.g. the port is taken)."""


def new_token() -> str:
    """A fresh random job token (URL-safe text of 24 random bytes) that every call must carry."""
    return secrets.token_urlsafe(24)


def job_name_for_token(token: str) -> str:
    """A job's name when none was given: stable for a token, so a master restarted with the
    same token (and state) keeps its name, and readable in logs (never the bare "none")."""
    return "job-" + hashlib.sha256(token.encode()).hexdigest()[:8]


_WRONG_TOKEN = "wrong or missing job token: set DLROVER_JOB_TOKEN to the token the master printed"


def _has_token(metadata: Any, token: str) -> bool:
    """Whether a call's metadata carries the job's token."""
    for key, value in metadata or ():
        if key == TOKEN_METADATA_KEY and secrets.compare_digest(str(value), token):
            return True
    return False


class _TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call whose metadata lacks the job's token."""

    def __init__(self, token: str) -> None:
        self._token = token

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _WRONG_TOKEN)

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if _has_token(handler_call_details.invocation_metadata, self._token):
            return await continuation(handler_call_details)
        return self._deny


class _SyncTokenInterceptor(grpc.ServerInterceptor):
    """`_TokenInterceptor` for the synchronous heartbeat server."""

    def __init__(self, token: str) -> None:
        self._token = token

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, _WRONG_TOKEN)

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        if _has_token(handler_call_details.invocation_metadata, self._token):
            return continuation(handler_call_details)
        return self._deny


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


GROUP_WINDOW_S = 0.002
"""While the master's sharding calls come together, a write of their changes waits until this
long after the one before, so that the calls arriving meanwhile share it
(`MasterServicer._answer_after_flush`): with 200 leases in flight, a third less CPU per call
(master_scale.py --calls). A call that comes alone is written at once."""


class MasterServicer:
    """The master's gRPC handlers, derived from the interfaces (`dlrover.api.wire.RPCS`): each
    RPC decodes its request into the interface method's arguments, runs the method on the part
    that serves its interface (`JobMaster.services`) inline, on the thread pool or as a long
    poll held on the loop, and encodes the answer; a refusal travels in the response (see
    `dlrover.api.rpc`)."""

    def __init__(
        self,
        job: JobMaster,
        loop: asyncio.AbstractEventLoop,
        executor: futures.Executor,
        heartbeat_port: int = 0,
    ) -> None:
        self.job = job
        self._loop = loop
        self._executor = executor
        self._heartbeat_port = heartbeat_port
        """The `HeartbeatLane`'s port, told in every heartbeat reply (0: none)."""
        feeds = (job.members.rounds, job.members.changes, job.preflight.checks)
        self._wakers = {id(feed): _Waker(loop, feed) for feed in feeds}
        implementations = job.services()
        self._implementations = implementations
        self._sharding = next(
            (part for part in implementations.values() if isinstance(part, ShardingService)), None
        )
        """The part whose state-changing calls on the loop share their writes
        (`_answer_after_flush`)."""
        self._waiting: list[asyncio.Future[None]] = []
        """The calls waiting for the next write of the sharding part's state."""
        self._last_flush = -math.inf
        self._last_group = 0
        """How many calls the last write served."""
        self._writes_stopped = False
        by_name: dict[str, list[Rpc]] = {}
        for call in RPCS.values():
            by_name.setdefault(call.name, []).append(call)
        self.handler = grpc.method_handlers_generic_handler(
            SERVICE.full_name,
            {
                # The request is parsed by the handler, not by gRPC: gRPC answers a request it
                # cannot parse with a bare INTERNAL status, and a malformed request is the
                # caller's error, to be named as such.
                name: grpc.unary_unary_rpc_method_handler(
                    self._handler(calls, implementations),
                    response_serializer=calls[0].response_type.SerializeToString,
                )
                for name, calls in by_name.items()
            },
        )
        """The generic handler of every RPC, for `grpc.aio.Server.add_generic_rpc_handlers`."""

    def close(self) -> None:
        """Detach from the job's change feeds."""
        for waker in self._wakers.values():
            waker.close()

    def _handler(
        self, calls: list[Rpc], implementations: dict[type, object]
    ) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Message]]:
        targets = [(call, implementations[call.interface]) for call in calls]
        request_type = calls[0].request_type
        stamp = self._heartbeat_port if calls[0] is RPCS["heartbeat"] else 0

        async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> Message:
            try:
                request = request_type.FromString(raw)
            except DecodeError as e:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, _malformed(request_type, raw, e)
                )
            # Methods sharing one RPC (checkpoint_committed and its wait) differ in a field.
            call, target = next(((c, t) for c, t in targets if c.matches(request)), targets[-1])
            try:
                response = call.encode_response(await self._run(call, target, request))
            except Exception as e:
                return _refused(call, e)
            if stamp:
                response.heartbeat_port = stamp  # type: ignore[attr-defined]
            return response  # type: ignore[no-any-return]

        return handle

    def sync_handler(self, call: Rpc) -> Callable[[bytes, grpc.ServicerContext], Message]:
        """``call`` (one answered at once) as the synchronous `HeartbeatLane` runs it, on its
        own thread."""
        target = self._implementations[call.interface]
        stamp = self._heartbeat_port if call is RPCS["heartbeat"] else 0

        def handle(raw: bytes, context: grpc.ServicerContext) -> Message:
            try:
                request = call.request_type.FromString(raw)
            except DecodeError as e:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, _malformed(call.request_type, raw, e)
                )
            try:
                args = call.decode_request(request)
                response = call.encode_response(getattr(target, call.method)(**args))
            except Exception as e:
                return _refused(call, e)
            if stamp:
                response.heartbeat_port = stamp  # type: ignore[attr-defined]
            return response  # type: ignore[no-any-return]

        return handle

    async def _run(self, call: Rpc, target: object, request: Message) -> Any:
        args = call.decode_request(request)
        if "wait_s" in args and math.isnan(args["wait_s"]):
            # NaN passes every min() and max() that bound a wait: the wait never ended.
            raise MasterRequestError(f"{call.name}: wait_s must be a number of seconds, got NaN")
        if call.options.max_wait_s is not None:
            args["wait_s"] = min(args["wait_s"], call.options.max_wait_s)
        run = call.options.run
        if run is Run.POLL:
            wait_s = args.pop("wait_s")
            poll = getattr(target, call.options.poll)(**args)
            return await self._hold(poll, wait_s)
        method = getattr(target, call.method)
        if run is Run.POOL or (run is Run.POOL_IF_WAITING and args["wait_s"] > 0):
            return await self._loop.run_in_executor(self._executor, lambda: method(**args))
        sharding = self._sharding
        if sharding is None or target is not sharding:
            return method(**args)
        with sharding.saves_deferred() as deferred:
            result = method(**args)
        # A read waits too while a write is pending: its answer may show what that write saves.
        if deferred.changed or self._waiting:
            await self._answer_after_flush(sharding)
        return result

    async def _answer_after_flush(self, sharding: ShardingService) -> None:
        """Wait for the one write of what the calls of this turn of the loop changed, or, while
        calls keep coming together (the last write served more than one), of the next
        `GROUP_WINDOW_S`: calls that come together share a transaction, and none is answered
        before its change is saved. A refused write fails each of them, as a call's own write
        did before."""
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._waiting.append(waiter)
        if len(self._waiting) == 1:
            wait = self._last_flush + GROUP_WINDOW_S - self._loop.time()
            if wait > 0 and self._last_group > 1:
                self._loop.call_later(wait, self._flush, sharding)
            else:
                self._loop.call_soon(self._flush, sharding)
        await waiter

    def _flush(self, sharding: ShardingService) -> None:
        waiting, self._waiting = self._waiting, []
        self._last_group = len(waiting)
        error: BaseException | None = None
        try:
            if self._writes_stopped:
                raise StateStoreError(
                    "this master stepped down (another took over the job's state): it writes "
                    "nothing more; ask the master that took over"
                )
            sharding.flush()
        except BaseException as e:  # every waiter hears of it, whatever it is
            error = e
        self._last_flush = self._loop.time()  # the window runs from the write's end
        for waiter in waiting:
            if waiter.done():  # its caller was cancelled
                continue
            if error is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(error)
        if error is not None and not isinstance(error, Exception):
            raise error

    def stop_writes(self) -> None:
        """Write nothing more (this master stepped down): a pending write of the sharding
        part's state fails its calls instead (callable from any thread)."""
        self._writes_stopped = True

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
            await waker.wait(generation, poll.sleep_s(deadline - now, self.job.clock()))


def _malformed(request_type: type[Message], raw: bytes, error: DecodeError) -> str:
    return (
        f"malformed {request_type.__name__} ({len(raw)} bytes): {error}; send it with "
        "dlrover's MasterClient of the master's version"
    )


def _refused(call: Rpc, error: Exception) -> Message:
    """The response that carries ``error`` as the call's refusal; re-raises an error that is
    not one (gRPC then answers UNKNOWN)."""
    refused = call.refusal(error)
    if refused is None:
        refused = call.refusal(as_refusal(error))
    if refused is None:
        raise error
    return refused  # type: ignore[no-any-return]


LANE_RPCS = [RPCS["heartbeat"]]
"""What `HeartbeatLane` serves."""
_LANE_STOP_S = 30.0
"""How long past its grace a stopping `HeartbeatLane` waits for its server to stop."""


class HeartbeatLane:
    """The master's heartbeats on a server of their own: a synchronous gRPC server (its own
    completion queue and threads) beside the asyncio one, serving the Heartbeat RPC alone, on
    the same host, with the same token.

    The asyncio server answers its calls in turn on one loop. When thousands of held calls are
    answered at once (a round that closes or breaks at 10,000 nodes, every node reporting an
    error in the same second), a heartbeat that arrives then waits behind all of them: seconds,
    while an agent's heartbeat must be answered within its interval. Here it waits only for the
    interpreter's lock, which the loop hands over every few milliseconds. Every heartbeat reply
    tells the node this port (`HeartbeatReply.heartbeat_port`); a node that cannot reach it
    beats at the master's own address, as before."""

    def __init__(self, token: str, host: str, port: int) -> None:
        self._executor = futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="dlrover-master-beat"
        )
        self._server = grpc.server(
            self._executor,
            interceptors=[_SyncTokenInterceptor(token)],
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
        )
        try:
            bound = self._server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as e:
            bound = 0
            why = str(e)
        else:
            why = "the port is in use"
        if bound == 0:
            raise MasterServerError(
                f"cannot listen for heartbeats on {host}:{port}: {why}; pick another "
                "--heartbeat-port, 0 for a free one, or -1 for none"
            )
        self.port = bound

    def start(self, servicer: MasterServicer) -> None:
        """Start serving `LANE_RPCS` with ``servicer``'s handlers (`MasterServicer.sync_handler`)."""
        handlers = {
            call.name: grpc.unary_unary_rpc_method_handler(
                servicer.sync_handler(call),
                response_serializer=call.response_type.SerializeToString,
            )
            for call in LANE_RPCS
        }
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
        )
        self._server.start()

    def stop(self, grace_s: float) -> threading.Event:
        """Stop serving; calls in flight get ``grace_s`` seconds. Returns at once: the event is
        set once the server has stopped, and its threads end then."""
        stopped: threading.Event = self._server.stop(grace_s)
        # The pool is shut down only once the server has stopped. Before, it can deadlock:
        # grpc's serving thread hands each new call to the pool while holding the server's
        # lock, and a shutdown that cancels queued calls runs their done-callbacks, which take
        # that lock, while holding the pool's own lock, which handing a call over takes. A
        # master answering heartbeats as it ended hung this way (20,000 nodes; 10 of 20 stops
        # of a flooded lane, tests/test_heartbeat_lane.py).
        threading.Thread(
            target=self._end_pool,
            args=(stopped, grace_s + _LANE_STOP_S),
            name="dlrover-lane-stop",
            daemon=True,
        ).start()
        return stopped

    def _end_pool(self, stopped: threading.Event, timeout_s: float) -> None:
        if stopped.wait(timeout_s):
            self._executor.shutdown(wait=False, cancel_futures=True)
        else:  # never shut down under a server that may still hand it calls
            logger.warning("the heartbeat server did not stop within %.0fs", timeout_s)


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
        heartbeat_port: int | None = None,
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
        self._lane: HeartbeatLane | None = None
        try:
            if heartbeat_port is not None:
                self._lane = HeartbeatLane(token, host, heartbeat_port)
            self.port = self._run(self._bind(host, port), 30.0)
        except BaseException:
            if self._lane is not None:
                self._lane.stop(0)
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
        self._servicer = MasterServicer(self.job, self._loop, self._executor, self.heartbeat_port)
        self._server.add_generic_rpc_handlers((self._servicer.handler,))
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

    @property
    def heartbeat_port(self) -> int:
        """The port of the `HeartbeatLane` (0: none; heartbeats come to `port`)."""
        return self._lane.port if self._lane is not None else 0

    def start(self) -> MasterServer:
        """Start serving and the tick thread; returns self."""
        if self._lane is not None and self._servicer is not None:
            self._lane.start(self._servicer)
        self._run(self._server.start(), 30.0)
        if self._full_gc_every_s > 0:
            gen0, gen1, _ = gc.get_threshold()
            gc.set_threshold(gen0, gen1, _NEVER)
        self._ticker.start()
        logger.info(
            "master of job %s listening on %s:%d%s",
            self.job.config.job_name,
            self.host,
            self.port,
            f" (heartbeats on port {self.heartbeat_port})" if self._lane is not None else "",
        )
        return self

    def _tick_loop(self) -> None:
        next_gc = time.monotonic() + self._full_gc_every_s
        while True:
            wait = self._tick_interval_s
            deadline = self.job.members.close_deadline()
            if deadline is not None:
                wait = min(wait, max(0.01, deadline - self.job.clock()))
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
        if self._servicer is not None:
            self._servicer.stop_writes()
        if self._lane is not None:
            self._lane.stop(0)
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
        # Calls blocked in a wait on a pool thread end now: the interpreter joins those threads
        # at exit, so one reader of a key nobody will set held a finished job's master 30 s.
        self.job.kv.close()
        self.job.checkpoint.close()
        lane_stopped = self._lane.stop(grace_s) if self._lane is not None else None
        if not self._loop.is_closed():
            try:
                self._run(self._server.stop(grace_s), grace_s + 1.0)
            except (futures.TimeoutError, RuntimeError):
                logger.warning("the master's server did not stop within %.1fs", grace_s + 1.0)
        self._shutdown_loop()
        if lane_stopped is not None and not lane_stopped.wait(grace_s + 1.0):
            logger.warning("the master's heartbeat server did not stop within %.1fs", grace_s + 1.0)
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
