"""The one wire client to the job master, used by agents and training processes alike."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from dlrover.constants import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_RPC_TIMEOUT_S,
    ENV_JOB_TOKEN,
    ENV_MASTER_ADDR,
    ENV_NODE_ID,
    MAX_MESSAGE_BYTES,
    TOKEN_METADATA_KEY,
)
from dlrover.proto import master_pb2 as pb
from dlrover.proto import master_pb2_grpc as pb_grpc

T = TypeVar("T")


class MasterClientError(Exception):
    """A call to the master failed; the message says what to do."""


class MasterUnreachableError(MasterClientError):
    """No master answered at the address within the deadline."""


class WrongTokenError(MasterClientError):
    """The master refused the job token."""


class MasterRequestError(MasterClientError):
    """The master refused the request as invalid (unknown node, bad configuration...)."""


class MasterClient:
    """Typed calls to the master. Every call has a deadline and carries the job token."""

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
            ],
        )
        self._stub = pb_grpc.MasterStub(self._channel)

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
        self._channel.close()

    def _call(self, fn: Callable[..., T], request: object, timeout_s: float | None = None) -> T:
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
    def register_node(self, request: pb.RegisterNodeRequest) -> pb.RegisterNodeResponse:
        return self._call(self._stub.RegisterNode, request)

    def heartbeat(self, request: pb.HeartbeatRequest) -> pb.HeartbeatResponse:
        return self._call(self._stub.Heartbeat, request)

    def join_rendezvous(self, request: pb.JoinRendezvousRequest) -> int:
        return self._call(self._stub.JoinRendezvous, request).round

    def get_comm_world(self, node_id: str, round: int) -> pb.CommWorld:
        return self._call(
            self._stub.GetCommWorld, pb.GetCommWorldRequest(node_id=node_id, round=round)
        )

    def num_nodes_waiting(self, node_id: str, round: int) -> pb.NumNodesWaitingResponse:
        return self._call(
            self._stub.NumNodesWaiting, pb.NumNodesWaitingRequest(node_id=node_id, round=round)
        )

    def report_node_status(self, request: pb.ReportNodeStatusRequest) -> bool:
        return self._call(self._stub.ReportNodeStatus, request).job_done

    def get_job_status(self) -> pb.JobStatus:
        return self._call(self._stub.GetJobStatus, pb.GetJobStatusRequest())

    def stop_job(self, reason: str) -> pb.JobStatus:
        return self._call(self._stub.StopJob, pb.StopJobRequest(reason=reason))

    # --- key-value -----------------------------------------------------------------------------
    def kv_set(self, key: str, value: bytes) -> None:
        self._call(self._stub.KvSet, pb.KvSetRequest(key=key, value=value))

    def kv_get(self, key: str, wait_s: float = 0.0) -> bytes | None:
        deadline = time.monotonic() + wait_s
        while True:
            left = max(0.0, deadline - time.monotonic())
            resp = self._call(
                self._stub.KvGet, pb.KvGetRequest(key=key, wait_s=left), left + self._timeout
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
        self._call(
            self._stub.ReportStep,
            pb.ReportStepRequest(
                node_id=node_id or os.environ.get(ENV_NODE_ID, ""),
                rank=int(os.environ.get("RANK", "0")) if rank is None else rank,
                step=step,
                timestamp=time.time(),
                metrics=metrics or {},
            ),
        )

    # --- dynamic data sharding -----------------------------------------------------------------
    # Each response holds the result or a typed `error`; dlrover.client.sharding's
    # GrpcShardingTransport turns them into the dataclasses and raises the error's class.
    def register_dataset(self, request: pb.RegisterDatasetRequest) -> pb.RegisterDatasetResponse:
        return self._call(self._stub.RegisterDataset, request)

    def fetch_shards(self, request: pb.FetchShardsRequest) -> pb.FetchShardsResponse:
        return self._call(self._stub.FetchShards, request)

    def report_done(self, request: pb.ReportDoneRequest) -> pb.ReportDoneResponse:
        return self._call(self._stub.ReportDone, request)

    def report_progress(self, request: pb.ReportProgressRequest) -> pb.ReportProgressResponse:
        return self._call(self._stub.ReportProgress, request)

    def renew_leases(self, request: pb.RenewLeasesRequest) -> pb.RenewLeasesResponse:
        return self._call(self._stub.RenewLeases, request)

    def get_position(self, request: pb.GetPositionRequest) -> pb.GetPositionResponse:
        return self._call(self._stub.GetPosition, request)

    def mark_consumption(self, request: pb.MarkConsumptionRequest) -> pb.MarkConsumptionResponse:
        return self._call(self._stub.MarkConsumption, request)

    def position_at(self, request: pb.PositionAtRequest) -> pb.PositionAtResponse:
        return self._call(self._stub.PositionAt, request)

    def restore_position(self, request: pb.RestorePositionRequest) -> pb.RestorePositionResponse:
        return self._call(self._stub.RestorePosition, request)

    def dataset_progress(self, request: pb.DatasetProgressRequest) -> pb.DatasetProgressResponse:
        return self._call(self._stub.DatasetProgress, request)
