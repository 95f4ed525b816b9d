"""The one translation between the sharding dataclasses and their protobuf messages.

Both sides use it: the master's gRPC adapter and the client's transport. A message's fields
mirror the dataclass of the same name in dlrover.sharding.types; `*_from_proto` rebuilds the
dataclass, so its validation (DatasetSpec's) runs on the receiving side too.
"""

from __future__ import annotations

from collections.abc import Iterable

from dlrover.proto import master_pb2 as pb
from dlrover.sharding import errors
from dlrover.sharding.stream import (
    StreamFetchResult,
    StreamMark,
    StreamPosition,
    StreamPositionAt,
    StreamProgress,
    StreamShard,
    StreamSpec,
)
from dlrover.sharding.types import (
    ConsumptionMark,
    DatasetProgress,
    DatasetSpec,
    DeliveryMode,
    FetchResult,
    Position,
    PositionAt,
    RegisterResult,
    ReportResult,
    Shard,
    ShardId,
)

# Every class of dlrover.sharding.errors has its kind (tests/sharding/test_sharding_wire.py).
_ERROR_KINDS: dict[type[errors.ShardingError], pb.ShardingError.Kind] = {
    errors.ShardingError: pb.ShardingError.SHARDING_ERROR,
    errors.InvalidSpecError: pb.ShardingError.INVALID_SPEC,
    errors.UnknownDatasetError: pb.ShardingError.UNKNOWN_DATASET,
    errors.DatasetConflictError: pb.ShardingError.DATASET_CONFLICT,
    errors.ShardRetriesExhaustedError: pb.ShardingError.SHARD_RETRIES_EXHAUSTED,
    errors.InvalidPositionError: pb.ShardingError.INVALID_POSITION,
    errors.ShardingTimeoutError: pb.ShardingError.SHARDING_TIMEOUT,
    errors.StreamSourceError: pb.ShardingError.STREAM_SOURCE,
}
_ERROR_CLASSES = {kind: cls for cls, kind in _ERROR_KINDS.items()}

_MODES: dict[DeliveryMode, pb.DatasetSpec.DeliveryMode] = {
    DeliveryMode.AT_LEAST_ONCE: pb.DatasetSpec.AT_LEAST_ONCE,
    DeliveryMode.EXACTLY_ONCE: pb.DatasetSpec.EXACTLY_ONCE,
}
_MODES_BY_NUMBER = {number: mode for mode, number in _MODES.items()}


# --- errors -----------------------------------------------------------------------------------
def error_to_proto(error: errors.ShardingError) -> pb.ShardingError:
    """The kind of the nearest class with one (a subclass travels as its base)."""
    kind = next(_ERROR_KINDS[cls] for cls in type(error).__mro__ if cls in _ERROR_KINDS)
    return pb.ShardingError(kind=kind, message=str(error))


def error_from_proto(message: pb.ShardingError) -> errors.ShardingError:
    """The error to raise; a kind this side does not know becomes the base ShardingError."""
    return _ERROR_CLASSES.get(message.kind, errors.ShardingError)(message.message)


# --- what is sent -----------------------------------------------------------------------------
def dataset_spec_to_proto(spec: DatasetSpec) -> pb.DatasetSpec:
    """A DatasetSpec as its message."""
    return pb.DatasetSpec(
        name=spec.name,
        size=spec.size,
        shard_size=spec.shard_size,
        batch_size=spec.batch_size,
        batches_per_shard=spec.batches_per_shard,
        epochs=spec.epochs,
        shuffle=spec.shuffle,
        seed=spec.seed,
        mode=_MODES[spec.mode],
        max_retries=spec.max_retries,
        lease_s=spec.lease_s,
    )


def dataset_spec_from_proto(message: pb.DatasetSpec) -> DatasetSpec:
    """Raises InvalidSpecError for a spec that cannot work, ValueError for an unknown mode."""
    mode = _MODES_BY_NUMBER.get(message.mode)
    if mode is None:
        raise ValueError(f"dataset {message.name!r}: unknown delivery mode {message.mode}")
    # An absent optional field takes the dataclass default, as an absent JSON key did.
    defaults = {
        name: getattr(message, name)
        for name in ("epochs", "max_retries", "lease_s")
        if message.HasField(name)
    }
    return DatasetSpec(
        name=message.name,
        size=message.size,
        shard_size=message.shard_size,
        batch_size=message.batch_size,
        batches_per_shard=message.batches_per_shard,
        shuffle=message.shuffle,
        seed=message.seed,
        mode=mode,
        **defaults,
    )


def shard_id_to_proto(shard_id: ShardId) -> pb.ShardId:
    """A ShardId as its message."""
    return pb.ShardId(epoch=shard_id.epoch, index=shard_id.index)


def shard_id_from_proto(message: pb.ShardId) -> ShardId:
    """A ShardId message back into a ShardId."""
    return ShardId(message.epoch, message.index)


def position_to_proto(position: Position) -> pb.Position:
    """A Position as its message, pending shards included."""
    return pb.Position(
        dataset=position.dataset,
        epoch=position.epoch,
        cursor=position.cursor,
        pending=[
            pb.PendingShard(epoch=epoch, index=index, offset=offset)
            for epoch, index, offset in position.pending
        ],
    )


def position_from_proto(message: pb.Position) -> Position:
    """A Position message back into a Position (not validated here: restore checks it)."""
    return Position(
        message.dataset,
        message.epoch,
        message.cursor,
        tuple((p.epoch, p.index, p.offset) for p in message.pending),
    )


def consumption_mark_to_proto(mark: ConsumptionMark) -> pb.ConsumptionMark:
    """A ConsumptionMark as its message; ``shard_id`` is set only when the mark has one."""
    message = pb.ConsumptionMark(epoch=mark.epoch, begin=mark.begin, offset=mark.offset)
    if mark.shard_id is not None:
        message.shard_id.CopyFrom(shard_id_to_proto(mark.shard_id))
    return message


def consumption_mark_from_proto(message: pb.ConsumptionMark) -> ConsumptionMark:
    """A ConsumptionMark message back into a ConsumptionMark (no shard when unset)."""
    shard_id = shard_id_from_proto(message.shard_id) if message.HasField("shard_id") else None
    return ConsumptionMark(message.epoch, message.begin, shard_id, message.offset)


# --- what comes back --------------------------------------------------------------------------
def register_result_to_proto(result: RegisterResult) -> pb.RegisterResult:
    """A RegisterResult as its message."""
    return pb.RegisterResult(dataset=result.dataset, created=result.created)


def register_result_from_proto(message: pb.RegisterResult) -> RegisterResult:
    """A RegisterResult message back into a RegisterResult."""
    return RegisterResult(message.dataset, message.created)


def shard_to_proto(shard: Shard) -> pb.Shard:
    """A leased Shard as its message."""
    return pb.Shard(
        dataset=shard.dataset,
        id=shard_id_to_proto(shard.id),
        start=shard.start,
        end=shard.end,
        offset=shard.offset,
        shuffle=shard.shuffle,
        seed=shard.seed,
        attempt=shard.attempt,
    )


def shard_from_proto(message: pb.Shard) -> Shard:
    """A Shard message back into a Shard."""
    return Shard(
        dataset=message.dataset,
        id=shard_id_from_proto(message.id),
        start=message.start,
        end=message.end,
        offset=message.offset,
        shuffle=message.shuffle,
        seed=message.seed,
        attempt=message.attempt,
    )


def fetch_result_to_proto(result: FetchResult) -> pb.FetchResult:
    """A FetchResult and its shards as a message."""
    return pb.FetchResult(
        shards=[shard_to_proto(s) for s in result.shards], finished=result.finished
    )


def fetch_result_from_proto(message: pb.FetchResult) -> FetchResult:
    """A FetchResult message back into a FetchResult."""
    return FetchResult(tuple(shard_from_proto(s) for s in message.shards), message.finished)


def report_result_to_proto(result: ReportResult) -> pb.ReportResult:
    """A ReportResult as its message."""
    return pb.ReportResult(accepted=result.accepted, ignored=result.ignored)


def report_result_from_proto(message: pb.ReportResult) -> ReportResult:
    """A ReportResult message back into a ReportResult."""
    return ReportResult(message.accepted, message.ignored)


def position_at_to_proto(result: PositionAt) -> pb.PositionAt:
    """A PositionAt as its message; ``position`` is set only when there is one."""
    message = pb.PositionAt(waiting_for=list(result.waiting_for))
    if result.position is not None:
        message.position.CopyFrom(position_to_proto(result.position))
    return message


def position_at_from_proto(message: pb.PositionAt) -> PositionAt:
    """A PositionAt message back into a PositionAt (no position when unset)."""
    position = position_from_proto(message.position) if message.HasField("position") else None
    return PositionAt(position, tuple(message.waiting_for))


def dataset_progress_to_proto(progress: DatasetProgress) -> pb.DatasetProgress:
    """DatasetProgress counters as their message."""
    return pb.DatasetProgress(
        dataset=progress.dataset,
        epoch=progress.epoch,
        todo=progress.todo,
        leased=progress.leased,
        done_shards=progress.done_shards,
        finished=progress.finished,
    )


def dataset_progress_from_proto(message: pb.DatasetProgress) -> DatasetProgress:
    """A DatasetProgress message back into DatasetProgress."""
    return DatasetProgress(
        dataset=message.dataset,
        epoch=message.epoch,
        todo=message.todo,
        leased=message.leased,
        done_shards=message.done_shards,
        finished=message.finished,
    )


# --- streams ----------------------------------------------------------------------------------
def _pairs_to_proto(pairs: tuple[tuple[int, int], ...]) -> list[pb.PartitionOffset]:
    return [pb.PartitionOffset(partition=p, offset=o) for p, o in pairs]


def _pairs_from_proto(messages: Iterable[pb.PartitionOffset]) -> tuple[tuple[int, int], ...]:
    return tuple((m.partition, m.offset) for m in messages)


def stream_spec_to_proto(spec: StreamSpec) -> pb.StreamSpec:
    """A StreamSpec as its message."""
    return pb.StreamSpec(
        name=spec.name,
        records_per_shard=spec.records_per_shard,
        max_retries=spec.max_retries,
        lease_s=spec.lease_s,
        topic=spec.topic,
        bootstrap_servers=spec.bootstrap_servers,
        group_id=spec.group_id,
        end_offsets=_pairs_to_proto(spec.end_offsets),
    )


def stream_spec_from_proto(message: pb.StreamSpec) -> StreamSpec:
    """Raises InvalidSpecError for a spec that cannot work."""
    defaults = {
        name: getattr(message, name)
        for name in ("max_retries", "lease_s")
        if message.HasField(name)
    }
    return StreamSpec(
        name=message.name,
        records_per_shard=message.records_per_shard,
        topic=message.topic,
        bootstrap_servers=message.bootstrap_servers,
        group_id=message.group_id,
        end_offsets=_pairs_from_proto(message.end_offsets),
        **defaults,
    )


def stream_shard_to_proto(shard: StreamShard) -> pb.StreamShard:
    """A leased StreamShard as its message."""
    return pb.StreamShard(
        stream=shard.stream,
        partition=shard.partition,
        start=shard.start,
        end=shard.end,
        attempt=shard.attempt,
    )


def stream_shard_from_proto(message: pb.StreamShard) -> StreamShard:
    """A StreamShard message back into a StreamShard."""
    return StreamShard(
        message.stream, message.partition, message.start, message.end, message.attempt
    )


def stream_position_to_proto(position: StreamPosition) -> pb.StreamPosition:
    """A StreamPosition as its message."""
    return pb.StreamPosition(
        stream=position.stream,
        offsets=_pairs_to_proto(position.offsets),
        pending=[pb.StreamRange(partition=p, start=s, end=e) for p, s, e in position.pending],
    )


def stream_position_from_proto(message: pb.StreamPosition) -> StreamPosition:
    """A StreamPosition message back (not validated here: restore checks it)."""
    return StreamPosition(
        message.stream,
        _pairs_from_proto(message.offsets),
        tuple((r.partition, r.start, r.end) for r in message.pending),
    )


def stream_mark_to_proto(mark: StreamMark) -> pb.StreamMark:
    """A StreamMark as its message; ``partition`` is set only when the mark names a shard."""
    message = pb.StreamMark(begin=mark.begin, start=mark.start)
    if mark.partition is not None:
        message.partition = mark.partition
    if mark.count is not None:
        message.count = mark.count
    return message


def stream_mark_from_proto(message: pb.StreamMark) -> StreamMark:
    """A StreamMark message back (no shard when ``partition`` is unset)."""
    partition = message.partition if message.HasField("partition") else None
    count = message.count if message.HasField("count") else None
    return StreamMark(message.begin, partition, message.start, count)


def stream_fetch_result_to_proto(result: StreamFetchResult) -> pb.StreamFetchResult:
    """A StreamFetchResult and its shards as a message."""
    return pb.StreamFetchResult(
        shards=[stream_shard_to_proto(s) for s in result.shards], finished=result.finished
    )


def stream_fetch_result_from_proto(message: pb.StreamFetchResult) -> StreamFetchResult:
    """A StreamFetchResult message back."""
    return StreamFetchResult(
        tuple(stream_shard_from_proto(s) for s in message.shards), message.finished
    )


def stream_position_at_to_proto(result: StreamPositionAt) -> pb.StreamPositionAt:
    """A StreamPositionAt as its message; ``position`` is set only when there is one."""
    message = pb.StreamPositionAt(waiting_for=list(result.waiting_for))
    if result.position is not None:
        message.position.CopyFrom(stream_position_to_proto(result.position))
    return message


def stream_position_at_from_proto(message: pb.StreamPositionAt) -> StreamPositionAt:
    """A StreamPositionAt message back (no position when unset)."""
    position = (
        stream_position_from_proto(message.position) if message.HasField("position") else None
    )
    return StreamPositionAt(position, tuple(message.waiting_for))


def stream_progress_to_proto(progress: StreamProgress) -> pb.StreamProgress:
    """StreamProgress counters as their message."""
    return pb.StreamProgress(
        stream=progress.stream,
        committed=_pairs_to_proto(progress.committed),
        end_offsets=_pairs_to_proto(progress.end_offsets),
        leased=progress.leased,
        stopped=progress.stopped,
        finished=progress.finished,
    )


def stream_progress_from_proto(message: pb.StreamProgress) -> StreamProgress:
    """A StreamProgress message back."""
    return StreamProgress(
        message.stream,
        _pairs_from_proto(message.committed),
        _pairs_from_proto(message.end_offsets),
        message.leased,
        message.stopped,
        message.finished,
    )
