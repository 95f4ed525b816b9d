"""The sharding wire format: every dataclass and error survives its protobuf message unchanged."""

from __future__ import annotations

import inspect
from typing import TypeVar

import pytest
from google.protobuf.message import Message

from dlrover.api import sharding_wire as wire
from dlrover.proto import master_pb2 as pb
from dlrover.sharding import errors
from dlrover.sharding.config import DEFAULT_LEASE_S, DEFAULT_MAX_RETRIES
from dlrover.sharding.manager import ShardManager
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

ERROR_CLASSES = [
    cls
    for _, cls in inspect.getmembers(errors, inspect.isclass)
    if issubclass(cls, errors.ShardingError)
]


M = TypeVar("M", bound=Message)


def through_bytes(message: M) -> M:
    """What the other side parses: the serialised message, not the object."""
    return type(message).FromString(message.SerializeToString())


@pytest.mark.parametrize(
    "spec",
    [
        DatasetSpec("d", size=10, shard_size=3),
        DatasetSpec(
            "e",
            size=1 << 40,
            batch_size=4,
            batches_per_shard=8,
            epochs=3,
            shuffle=True,
            seed=-7,
            mode=DeliveryMode.EXACTLY_ONCE,
            max_retries=0,
            lease_s=0.25,
        ),
    ],
)
def test_dataset_spec_round_trips(spec: DatasetSpec) -> None:
    assert wire.dataset_spec_from_proto(through_bytes(wire.dataset_spec_to_proto(spec))) == spec


def test_absent_optional_spec_fields_take_the_defaults_and_zero_stays_zero() -> None:
    spec = wire.dataset_spec_from_proto(pb.DatasetSpec(name="d", size=5, shard_size=1))
    defaults = (1, DEFAULT_MAX_RETRIES, DEFAULT_LEASE_S)
    assert (spec.epochs, spec.max_retries, spec.lease_s) == defaults
    no_retries = pb.DatasetSpec(name="d", size=5, shard_size=1, max_retries=0)
    assert wire.dataset_spec_from_proto(through_bytes(no_retries)).max_retries == 0


def test_a_spec_that_cannot_work_is_refused_on_the_receiving_side() -> None:
    with pytest.raises(errors.InvalidSpecError, match="epochs must be >= 1"):
        wire.dataset_spec_from_proto(pb.DatasetSpec(name="d", size=5, shard_size=1, epochs=0))
    with pytest.raises(ValueError, match="unknown delivery mode 7"):
        unknown_mode = pb.DatasetSpec(name="d", size=5, shard_size=1, mode=7)  # type: ignore[arg-type]
        wire.dataset_spec_from_proto(unknown_mode)


def test_requests_round_trip() -> None:
    shard_id = ShardId(2, 41)
    assert wire.shard_id_from_proto(through_bytes(wire.shard_id_to_proto(shard_id))) == shard_id
    position = Position("d", 1, 17, ((0, 3, 5), (1, 2, 0)))
    assert wire.position_from_proto(through_bytes(wire.position_to_proto(position))) == position
    for mark in (ConsumptionMark(1, 40, ShardId(1, 0), 0), ConsumptionMark(1, 99)):
        message = through_bytes(wire.consumption_mark_to_proto(mark))
        assert wire.consumption_mark_from_proto(message) == mark


def test_results_round_trip() -> None:
    shards = (
        Shard("d", ShardId(0, 4), 40, 50),
        Shard("d", ShardId(1, 0), 0, 10, offset=3, shuffle=True, seed=(1 << 63) - 1, attempt=2),
    )
    cases = [
        (RegisterResult("d", True), wire.register_result_to_proto, wire.register_result_from_proto),
        (FetchResult(shards, False), wire.fetch_result_to_proto, wire.fetch_result_from_proto),
        (FetchResult((), True), wire.fetch_result_to_proto, wire.fetch_result_from_proto),
        (ReportResult(3, 1), wire.report_result_to_proto, wire.report_result_from_proto),
        (
            PositionAt(Position("d", 0, 2, ((0, 1, 4),))),
            wire.position_at_to_proto,
            wire.position_at_from_proto,
        ),
        (
            PositionAt(None, ("n0/1", "n1/0")),
            wire.position_at_to_proto,
            wire.position_at_from_proto,
        ),
        (
            DatasetProgress("d", 1, 4, 2, 9, False),
            wire.dataset_progress_to_proto,
            wire.dataset_progress_from_proto,
        ),
    ]
    for value, to_proto, from_proto in cases:
        assert from_proto(through_bytes(to_proto(value))) == value  # type: ignore[operator]


def test_shuffled_shards_keep_their_sample_order_over_the_wire() -> None:
    manager = ShardManager()
    manager.register_dataset(DatasetSpec("d", size=25, shard_size=10, shuffle=True, seed=3))
    result = manager.fetch_shards("d", "w", 3)
    again = wire.fetch_result_from_proto(through_bytes(wire.fetch_result_to_proto(result)))
    assert again == result
    assert [list(s.indices()) for s in again.shards] == [list(s.indices()) for s in result.shards]


def test_every_error_class_has_a_kind_of_its_own() -> None:
    kinds = {wire.error_to_proto(cls("m")).kind for cls in ERROR_CLASSES}
    assert len(kinds) == len(ERROR_CLASSES) == len(pb.ShardingError.Kind.values())


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda cls: cls.__name__)
def test_an_error_comes_back_as_the_same_class_with_its_message(
    cls: type[errors.ShardingError],
) -> None:
    message = "dataset 'd: x' is not registered (known: ['a']); InvalidSpecError: not a name"
    back = wire.error_from_proto(through_bytes(wire.error_to_proto(cls(message))))
    assert type(back) is cls
    assert str(back) == message


def test_a_subclass_travels_as_its_base_and_an_unknown_kind_as_sharding_error() -> None:
    class NarrowError(errors.UnknownDatasetError):
        pass

    assert type(wire.error_from_proto(wire.error_to_proto(NarrowError("x")))) is (
        errors.UnknownDatasetError
    )
    future = pb.ShardingError(kind=99, message="from a newer master")  # type: ignore[arg-type]
    back = wire.error_from_proto(through_bytes(future))
    assert type(back) is errors.ShardingError
    assert str(back) == "from a newer master"
