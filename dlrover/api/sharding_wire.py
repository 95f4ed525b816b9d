"""The sharding dataclasses' messages by name: the master's one mapper (dlrover.api.wire) does
every conversion; these names stay for the tests and tools that call them.

A message's fields mirror the dataclass of the same name in dlrover.sharding.types; decoding
rebuilds the dataclass, so its validation (DatasetSpec's) runs on the receiving side too.
"""

from __future__ import annotations

from dlrover.api.rpc import sharding_error_from_proto as error_from_proto
from dlrover.api.rpc import sharding_error_to_proto as error_to_proto
from dlrover.api.wire import MAPPER
from dlrover.proto import master_pb2 as pb
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

__all__ = ["error_from_proto", "error_to_proto"]

dataset_spec_to_proto, dataset_spec_from_proto = MAPPER.pair(DatasetSpec, pb.DatasetSpec)
shard_id_to_proto, shard_id_from_proto = MAPPER.pair(ShardId, pb.ShardId)
position_to_proto, position_from_proto = MAPPER.pair(Position, pb.Position)
consumption_mark_to_proto, consumption_mark_from_proto = MAPPER.pair(
    ConsumptionMark, pb.ConsumptionMark
)
register_result_to_proto, register_result_from_proto = MAPPER.pair(
    RegisterResult, pb.RegisterResult
)
fetch_result_to_proto, fetch_result_from_proto = MAPPER.pair(FetchResult, pb.FetchResult)
report_result_to_proto, report_result_from_proto = MAPPER.pair(ReportResult, pb.ReportResult)
position_at_to_proto, position_at_from_proto = MAPPER.pair(PositionAt, pb.PositionAt)
dataset_progress_to_proto, dataset_progress_from_proto = MAPPER.pair(
    DatasetProgress, pb.DatasetProgress
)
