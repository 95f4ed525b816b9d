"""The gRPC ShardingTransport: each ShardingTransport method is the master's RPC of that name."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

from dlrover.client.master_client import MasterClient
from dlrover.constants import ENV_JOB_TOKEN
from dlrover.proto import master_pb2 as pb
from dlrover.sharding import wire
from dlrover.sharding.stream import (
    StreamFetchResult,
    StreamMark,
    StreamPosition,
    StreamPositionAt,
    StreamProgress,
    StreamSpec,
)
from dlrover.sharding.types import (
    ConsumptionMark,
    DatasetProgress,
    DatasetSpec,
    FetchResult,
    Position,
    PositionAt,
    RegisterResult,
    ReportResult,
    ShardId,
)


class _Response(Protocol):
    """A sharding response: the result, or the ShardingError the master refused the call with."""

    @property
    def error(self) -> pb.ShardingError: ...

    def HasField(self, field_name: Any) -> bool: ...  # noqa: N802


R = TypeVar("R", bound=_Response)


def _accepted(response: R) -> R:
    """The response, or raise the class of dlrover.sharding.errors the master refused it with."""
    if response.HasField("error"):
        raise wire.error_from_proto(response.error)
    return response


class GrpcShardingTransport:
    """Reaches the master's ShardManager over the wire; thread-safe (gRPC channels are).

    A sharding refusal raises its own class from dlrover.sharding.errors; a request the
    master finds malformed raises MasterRequestError, an unreachable master
    MasterUnreachableError (see MasterClient).
    """

    def __init__(self, client: MasterClient) -> None:
        self._client = client

    def register_dataset(self, spec: DatasetSpec) -> RegisterResult:
        """Register ``spec`` with the master (RegisterDataset RPC)."""
        request = pb.RegisterDatasetRequest(spec=wire.dataset_spec_to_proto(spec))
        response = _accepted(self._client.call(self._client.stub.RegisterDataset, request))
        return wire.register_result_from_proto(response.result)

    def fetch_shards(self, dataset: str, worker_id: str, max_count: int) -> FetchResult:
        """Lease up to ``max_count`` shards to ``worker_id`` (FetchShards RPC)."""
        request = pb.FetchShardsRequest(dataset=dataset, worker_id=worker_id, max_count=max_count)
        response = _accepted(self._client.call(self._client.stub.FetchShards, request))
        return wire.fetch_result_from_proto(response.result)

    def report_done(
        self, dataset: str, worker_id: str, shard_ids: Sequence[ShardId]
    ) -> ReportResult:
        """Report shards ``worker_id`` finished (ReportDone RPC)."""
        request = pb.ReportDoneRequest(
            dataset=dataset,
            worker_id=worker_id,
            shard_ids=[wire.shard_id_to_proto(s) for s in shard_ids],
        )
        response = _accepted(self._client.call(self._client.stub.ReportDone, request))
        return wire.report_result_from_proto(response.result)

    def report_progress(
        self, dataset: str, worker_id: str, shard_id: ShardId, consumed: int
    ) -> bool:
        """Report samples trained in a shard (ReportProgress RPC); False if the lease is lost."""
        request = pb.ReportProgressRequest(
            dataset=dataset,
            worker_id=worker_id,
            shard_id=wire.shard_id_to_proto(shard_id),
            consumed=consumed,
        )
        return _accepted(self._client.call(self._client.stub.ReportProgress, request)).accepted

    def renew_leases(self, dataset: str, worker_id: str) -> int:
        """Extend every lease ``worker_id`` holds (RenewLeases RPC); returns how many."""
        request = pb.RenewLeasesRequest(dataset=dataset, worker_id=worker_id)
        return _accepted(self._client.call(self._client.stub.RenewLeases, request)).renewed

    def get_position(self, dataset: str) -> Position:
        """The dataset's consumed position now (GetPosition RPC)."""
        response = _accepted(
            self._client.call(self._client.stub.GetPosition, pb.GetPositionRequest(dataset=dataset))
        )
        return wire.position_from_proto(response.position)

    def mark_consumption(self, dataset: str, worker_id: str, mark: ConsumptionMark) -> None:
        """Record where ``worker_id`` stands in its iteration (MarkConsumption RPC)."""
        request = pb.MarkConsumptionRequest(
            dataset=dataset, worker_id=worker_id, mark=wire.consumption_mark_to_proto(mark)
        )
        _accepted(self._client.call(self._client.stub.MarkConsumption, request))

    def position_at(self, dataset: str, epoch: int, consumed: int) -> PositionAt:
        """The position at a step of every worker, or who it waits for (PositionAt RPC)."""
        request = pb.PositionAtRequest(dataset=dataset, epoch=epoch, consumed=consumed)
        response = _accepted(self._client.call(self._client.stub.PositionAt, request))
        return wire.position_at_from_proto(response.result)

    def restore_position(self, position: Position, token: str | None) -> bool:
        """Reset the dataset to ``position``, once per ``token`` (RestorePosition RPC)."""
        request = pb.RestorePositionRequest(position=wire.position_to_proto(position))
        if token is not None:
            request.token = token
        return _accepted(self._client.call(self._client.stub.RestorePosition, request)).applied

    def dataset_progress(self, dataset: str) -> DatasetProgress:
        """The dataset's progress counters (DatasetProgress RPC)."""
        request = pb.DatasetProgressRequest(dataset=dataset)
        response = _accepted(self._client.call(self._client.stub.DatasetProgress, request))
        return wire.dataset_progress_from_proto(response.result)

    # --- streams ------------------------------------------------------------------------------
    def register_stream(self, spec: StreamSpec) -> RegisterResult:
        """Register a stream over a Kafka topic (RegisterStream RPC)."""
        request = pb.RegisterStreamRequest(spec=wire.stream_spec_to_proto(spec))
        response = _accepted(self._client.call(self._client.stub.RegisterStream, request))
        return wire.register_result_from_proto(response.result)

    def fetch_stream_shards(self, stream: str, worker_id: str, max_count: int) -> StreamFetchResult:
        """Lease record ranges to ``worker_id`` (FetchStreamShards RPC)."""
        request = pb.FetchStreamShardsRequest(
            stream=stream, worker_id=worker_id, max_count=max_count
        )
        response = _accepted(self._client.call(self._client.stub.FetchStreamShards, request))
        return wire.stream_fetch_result_from_proto(response.result)

    def report_stream_done(
        self, stream: str, worker_id: str, shards: Sequence[tuple[int, int]]
    ) -> int:
        """Report ranges finished (ReportStreamDone RPC); returns how many were open."""
        request = pb.ReportStreamDoneRequest(
            stream=stream,
            worker_id=worker_id,
            shards=[pb.StreamRange(partition=p, start=s) for p, s in shards],
        )
        return _accepted(self._client.call(self._client.stub.ReportStreamDone, request)).accepted

    def return_stream_shards(
        self, stream: str, worker_id: str, remainders: Sequence[tuple[int, int, int, int]]
    ) -> int:
        """Give back ranges the worker will not read further (ReturnStreamShards RPC)."""
        request = pb.ReturnStreamShardsRequest(
            stream=stream,
            worker_id=worker_id,
            shards=[
                pb.StreamRemainder(partition=p, start=s, resume=r, yielded=n)
                for p, s, r, n in remainders
            ],
        )
        return _accepted(self._client.call(self._client.stub.ReturnStreamShards, request)).accepted

    def renew_stream_leases(self, stream: str, worker_id: str) -> int:
        """Extend the worker's leases on the stream (RenewStreamLeases RPC)."""
        request = pb.RenewLeasesRequest(dataset=stream, worker_id=worker_id)
        return _accepted(self._client.call(self._client.stub.RenewStreamLeases, request)).renewed

    def mark_stream(self, stream: str, worker_id: str, mark: StreamMark) -> bool:
        """Record where the worker stands in its pass (MarkStream RPC); False when it does not
        hold the marked range."""
        request = pb.MarkStreamRequest(
            stream=stream, worker_id=worker_id, mark=wire.stream_mark_to_proto(mark)
        )
        return _accepted(self._client.call(self._client.stub.MarkStream, request)).accepted

    def stream_position_at(self, stream: str, consumed: int) -> StreamPositionAt:
        """The position at a record count of every worker (StreamPositionAt RPC)."""
        request = pb.StreamPositionAtRequest(stream=stream, consumed=consumed)
        response = _accepted(self._client.call(self._client.stub.StreamPositionAt, request))
        return wire.stream_position_at_from_proto(response.result)

    def restore_stream_position(self, position: StreamPosition, token: str | None) -> bool:
        """Restart the stream at ``position``, once per ``token`` (RestoreStreamPosition RPC)."""
        request = pb.RestoreStreamPositionRequest(position=wire.stream_position_to_proto(position))
        if token is not None:
            request.token = token
        call = self._client.stub.RestoreStreamPosition
        return _accepted(self._client.call(call, request)).applied

    def stop_stream(self, stream: str) -> StreamProgress:
        """End the stream once the ranges in flight are done (StopStream RPC)."""
        request = pb.StreamProgressRequest(stream=stream)
        response = _accepted(self._client.call(self._client.stub.StopStream, request))
        return wire.stream_progress_from_proto(response.result)

    def stream_progress(self, stream: str) -> StreamProgress:
        """The stream's counters (StreamProgress RPC)."""
        request = pb.StreamProgressRequest(stream=stream)
        response = _accepted(self._client.call(self._client.stub.StreamProgress, request))
        return wire.stream_progress_from_proto(response.result)


def connect(master_addr: str, token: str | None = None) -> GrpcShardingTransport:
    """A transport to the master at `master_addr` (token: argument or $DLROVER_JOB_TOKEN)."""
    token = os.environ.get(ENV_JOB_TOKEN, "") if token is None else token
    return GrpcShardingTransport(MasterClient(master_addr, token))
