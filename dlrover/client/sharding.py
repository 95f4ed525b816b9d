"""The gRPC ShardingTransport: each ShardingTransport method is one `Sharding` call."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from dlrover.client.master_client import MasterClient, MasterRequestError
from dlrover.constants import ENV_JOB_TOKEN
from dlrover.proto import master_pb2 as pb
from dlrover.sharding import errors
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


class GrpcShardingTransport:
    """Reaches the master's ShardManager over the wire; thread-safe (gRPC channels are)."""

    def __init__(self, client: MasterClient) -> None:
        self._client = client

    def _call(self, method: str, **args: Any) -> Any:
        request = pb.ShardingRequest(method=method, args_json=json.dumps(args).encode())
        try:
            response = self._client._call(self._client._stub.Sharding, request)
        except MasterRequestError as e:
            name, _, message = str(e).partition(": ")
            cls = getattr(errors, name, None)
            if isinstance(cls, type) and issubclass(cls, errors.ShardingError):
                raise cls(message) from None
            raise
        return json.loads(response.result_json)

    def register_dataset(self, spec: DatasetSpec) -> RegisterResult:
        return RegisterResult(**self._call("register_dataset", spec=spec.to_dict()))

    def fetch_shards(self, dataset: str, worker_id: str, max_count: int) -> FetchResult:
        return FetchResult.from_dict(
            self._call("fetch_shards", dataset=dataset, worker_id=worker_id, max_count=max_count)
        )

    def report_done(
        self, dataset: str, worker_id: str, shard_ids: Sequence[ShardId]
    ) -> ReportResult:
        return ReportResult(
            **self._call(
                "report_done",
                dataset=dataset,
                worker_id=worker_id,
                shard_ids=[s.to_list() for s in shard_ids],
            )
        )

    def report_progress(
        self, dataset: str, worker_id: str, shard_id: ShardId, consumed: int
    ) -> bool:
        return bool(
            self._call(
                "report_progress",
                dataset=dataset,
                worker_id=worker_id,
                shard_id=shard_id.to_list(),
                consumed=consumed,
            )
        )

    def renew_leases(self, dataset: str, worker_id: str) -> int:
        return int(self._call("renew_leases", dataset=dataset, worker_id=worker_id))

    def get_position(self, dataset: str) -> Position:
        return Position.from_dict(self._call("get_position", dataset=dataset))

    def mark_consumption(self, dataset: str, worker_id: str, mark: ConsumptionMark) -> None:
        self._call("mark_consumption", dataset=dataset, worker_id=worker_id, mark=mark.to_dict())

    def position_at(self, dataset: str, epoch: int, consumed: int) -> PositionAt:
        return PositionAt.from_dict(
            self._call("position_at", dataset=dataset, epoch=epoch, consumed=consumed)
        )

    def restore_position(self, position: Position, token: str | None) -> bool:
        return bool(self._call("restore_position", position=position.to_dict(), token=token))

    def dataset_progress(self, dataset: str) -> DatasetProgress:
        return DatasetProgress(**self._call("dataset_progress", dataset=dataset))


def connect(master_addr: str, token: str | None = None) -> GrpcShardingTransport:
    """A transport to the master at `master_addr` (token: argument or $DLROVER_JOB_TOKEN)."""
    token = os.environ.get(ENV_JOB_TOKEN, "") if token is None else token
    return GrpcShardingTransport(MasterClient(master_addr, token))
