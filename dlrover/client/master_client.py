"""The one wire client to the job master, used by agents and training processes alike."""

from __future__ import annotations

import os
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
from dlrover.api.master import MASTER_PARTS, MasterApi
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

CHECKPOINT_WAIT_S = 5.0
"""One checkpoint wait held in the master; the client asks again until its own deadline."""

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
