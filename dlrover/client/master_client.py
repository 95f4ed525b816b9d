"""The one wire client to the job master, used by agents and training processes alike."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import grpc
from google.protobuf.message import Message

from dlrover.api.errors import (
    MasterClientError,
    MasterRequestError,
    MasterUnreachableError,
    UnknownNodeError,
    UnsupportedCallError,
    WrongTokenError,
)
from dlrover.api.master import MASTER_PARTS, HeartbeatReply, HeartbeatReport, MasterApi
from dlrover.api.rpc import Rpc, derive_client, raise_refused
from dlrover.api.wire import RPCS
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

logger = logging.getLogger(__name__)

CHECKPOINT_WAIT_S = 5.0
"""One checkpoint wait held in the master; the client asks again until its own deadline."""

HEARTBEAT_LANE_TIMEOUT_S = 5.0
"""The deadline of a heartbeat sent to the master's heartbeat server; one that misses it goes to
the master's address at once (an agent's heartbeat must land within its interval)."""

HEARTBEAT_LANE_RETRY_S = 60.0
"""After a heartbeat server did not answer, heartbeats go to the master's address this long
before it is tried again."""

T = TypeVar("T")


_MasterRpcs: Any = derive_client(
    "_MasterRpcs", {m: call for m, call in RPCS.items() if call.interface in MASTER_PARTS}
)
"""A method per MasterApi RPC, made from the interface (typed Any: mypy reads the methods'
signatures from MasterApi, which MasterClient names as its base too)."""


class MasterClient(_MasterRpcs, MasterApi):
    """`dlrover.api.master.MasterApi` over gRPC: domain types in and out, protobuf stays inside.
    Its methods are derived from the interface (`dlrover.api.rpc`); only the calls with more to
    do on this side than one RPC are written here.

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
        self._channel = self._new_channel(addr)
        self.stub = pb_grpc.MasterStub(self._channel)
        self._lane_lock = threading.Lock()
        self._lane: tuple[int, grpc.Channel, pb_grpc.MasterStub] | None = None
        """The master's heartbeat server as its last heartbeat reply named it: (port, channel,
        stub); None: heartbeats go to ``addr``."""
        self._lane_failed: tuple[int, float] = (0, 0.0)
        """The heartbeat port that last did not answer, and until when it is not tried again."""

    def _new_channel(self, addr: str) -> grpc.Channel:
        return grpc.insecure_channel(
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
        """Close the channels; calls after this fail."""
        self._follow_lane(0)
        self._channel.close()

    def call(self, fn: Callable[..., T], request: object, timeout_s: float | None = None) -> T:
        """One RPC of `stub` with this client's deadline and token; gRPC failures and the
        master's refusal (a response's ``refused``) become the errors of `dlrover.api.errors`.
        A sharding refusal stays in the response's ``error`` (its typed method raises it)."""
        try:
            response = fn(request, timeout=timeout_s or self._timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            details = e.details() if hasattr(e, "details") else str(e)
            if code == grpc.StatusCode.UNAUTHENTICATED:
                raise WrongTokenError(
                    f"the master at {self.addr} refused the job token: set {ENV_JOB_TOKEN} to the "
                    "token dlrover-master printed"
                ) from None
            if code == grpc.StatusCode.UNIMPLEMENTED:
                raise UnsupportedCallError(
                    f"the master at {self.addr} does not know this call ({details}): it runs "
                    "an older DLRover release than this worker; run the same release on both"
                ) from None
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise MasterUnreachableError(
                    f"the DLRover master at {self.addr} did not answer ({details})"
                ) from None
            raise MasterClientError(
                f"call to the master at {self.addr} failed: {details}"
            ) from None
        raise_refused(cast(Message, response))
        return response

    def invoke(self, call: Rpc, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One RPC of the interfaces (`dlrover.api.wire.RPCS`) with these arguments: its request
        encoded, sent with this client's deadline (a long poll's: what the master may hold it
        plus the usual time) and token, its answer decoded; refusals raise."""
        request = call.encode_request(args, kwargs)
        timeout = None
        if "wait_s" in request.DESCRIPTOR.fields_by_name:
            timeout = self._held(request.wait_s)  # type: ignore[attr-defined]
        return call.decode_response(self.call(getattr(self.stub, call.name), request, timeout))

    def _held(self, wait_s: float) -> float:
        """The deadline of a long poll: what the master may hold it, plus the usual RPC time."""
        return min(max(0.0, wait_s), MAX_LONG_POLL_S) + self._timeout

    # --- calls with more to do on this side than one RPC ---------------------------------------
    def heartbeat(self, report: HeartbeatReport) -> HeartbeatReply:
        """`MasterApi.heartbeat`, sent where the master's last reply said: its heartbeat server
        (`HeartbeatReply.heartbeat_port`, on the host of ``addr``), which answers whatever else
        the master is busy with, else ``addr``. A heartbeat the heartbeat server does not answer
        within HEARTBEAT_LANE_TIMEOUT_S, or answers with a failure of the call itself (not the
        master's refusal: a wrong token, an unknown call, where another process took the port),
        goes to ``addr`` at once, and so do the next ones for HEARTBEAT_LANE_RETRY_S (a port the
        network between does not pass)."""
        call = RPCS["heartbeat"]
        lane = self._lane
        if lane is not None:
            port, _, stub = lane
            request = call.encode_request((report,), {})
            try:
                response = stub.Heartbeat(
                    request, timeout=HEARTBEAT_LANE_TIMEOUT_S, metadata=self._metadata
                )
            except grpc.RpcError as e:
                details = e.details() if hasattr(e, "details") else str(e)
                logger.warning(
                    "the master's heartbeat server at %s:%d failed a heartbeat (%s); "
                    "heartbeats go to %s for the next %.0fs",
                    self.addr.rsplit(":", 1)[0],
                    port,
                    details,
                    self.addr,
                    HEARTBEAT_LANE_RETRY_S,
                )
                with self._lane_lock:
                    self._lane_failed = (port, time.monotonic() + HEARTBEAT_LANE_RETRY_S)
                self._follow_lane(0)
            else:
                raise_refused(cast(Message, response))
                reply: HeartbeatReply = call.decode_response(response)
                self._follow_lane(reply.heartbeat_port)
                return reply
        reply = self.invoke(call, (report,), {})
        self._follow_lane(reply.heartbeat_port)
        return reply

    def _follow_lane(self, port: int) -> None:
        """Send the next heartbeats to the master's heartbeat server on ``port`` (0: to
        ``addr``), unless that port just failed."""
        with self._lane_lock:
            current = self._lane
            if (current[0] if current else 0) == port:
                return
            failed, until = self._lane_failed
            if port and port == failed and time.monotonic() < until:
                return
            self._lane = None
            if port:
                host = self.addr.rsplit(":", 1)[0]
                channel = self._new_channel(f"{host}:{port}")
                self._lane = (port, channel, pb_grpc.MasterStub(channel))
        if current is not None:
            current[1].close()

    def report_step(
        self,
        step: int,
        rank: int | None = None,
        metrics: dict[str, float] | None = None,
        node_id: str | None = None,
    ) -> None:
        """Tell the master the training step this process has completed (ReportStep RPC); the
        node and rank default to this process's."""
        rank = WorkerContext.from_env().rank if rank is None else rank
        _MasterRpcs.report_step(
            self, step, rank, metrics or {}, node_id or os.environ.get(ENV_NODE_ID, "")
        )

    def kv_get(self, key: str, wait_s: float = 0.0) -> bytes | None:
        """The value of ``key``, asking again until ``wait_s`` seconds have passed (the master holds
        each KvGet at most MAX_KV_WAIT_S); None if it never appeared."""
        deadline = time.monotonic() + wait_s
        while True:
            value: bytes | None = _MasterRpcs.kv_get(
                self, key, max(0.0, deadline - time.monotonic())
            )
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                return None

    def wait_checkpoint_committed(self, step: int, wait_s: float) -> bool:
        """Whether ``step`` is committed within ``wait_s`` (asking again every few seconds)."""
        deadline = time.monotonic() + wait_s
        while True:
            wait = min(CHECKPOINT_WAIT_S, max(0.0, deadline - time.monotonic()))
            if _MasterRpcs.wait_checkpoint_committed(self, step, wait):
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
            decided, step = _MasterRpcs.vote_load_step(
                self, node_rank, total_nodes, local_step, round_id, wait
            )
            if decided:
                return True, step
            if time.monotonic() >= deadline:
                return False, None
