"""What both sides of the embedding servers share: the map on the wire and the refusals that
ask the caller to route again."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dlrover.constants import PS_PLACEMENT_KEY
from dlrover.coordination import KvChannel
from dlrover.embedding.buckets import BucketMap
from dlrover.embedding.table import EmbeddingError
from dlrover.proto import embedding_pb2 as pb

MAX_MESSAGE_BYTES = 64 << 20
"""The largest message an embedding server or client accepts."""
CHUNK_BYTES = 8 << 20
"""Requests are cut so that a request or its answer stays near this size."""


def chunk_ids(dim: int) -> int:
    """Ids per request so that their rows (and ids) stay near CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // (dim * 4 + 8))


@dataclass(frozen=True)
class Placement:
    """A bucket map and the address of each server it names."""

    map: BucketMap
    addresses: tuple[str, ...]

    def to_proto(self) -> pb.BucketMapMessage:
        """As its message (owners as little-endian int32)."""
        owners = np.asarray(self.map.owners, dtype="<i4").tobytes()
        return pb.BucketMapMessage(
            version=self.map.version, owners=owners, addresses=list(self.addresses)
        )

    @classmethod
    def from_proto(cls, message: pb.BucketMapMessage) -> Placement:
        """A BucketMapMessage back into a Placement; EmbeddingError for a map that cannot route
        (no buckets, or an owner that is none of its addresses)."""
        if not message.owners or len(message.owners) % 4:
            raise EmbeddingError(
                f"a bucket map needs one int32 owner per bucket: got {len(message.owners)} bytes"
            )
        owners = np.frombuffer(message.owners, dtype="<i4")
        servers = len(message.addresses)
        if owners.min() < 0 or owners.max() >= servers:
            raise EmbeddingError(
                f"bucket map version {message.version} names owners {owners.min()} .. "
                f"{owners.max()} but has {servers} addresses"
            )
        bucket_map = BucketMap(message.version, tuple(int(o) for o in owners))
        return cls(bucket_map, tuple(message.addresses))


class NotOwnerError(EmbeddingError):
    """Ids of buckets the server does not own; ``newer`` is its placement when it has one."""

    def __init__(self, message: str, newer: Placement | None) -> None:
        super().__init__(message)
        self.newer = newer


class MovingError(EmbeddingError):
    """Ids of buckets being moved to another server: ask again shortly."""


def buckets_from_bytes(data: bytes, num_buckets: int) -> npt.NDArray[np.int64]:
    """Little-endian int64 bucket numbers, each below ``num_buckets``; EmbeddingError if not."""
    if num_buckets < 1 or len(data) % 8:
        raise EmbeddingError(
            f"buckets must be int64s of a map with at least one bucket: got {len(data)} bytes "
            f"of {num_buckets} buckets"
        )
    buckets = np.frombuffer(data, dtype="<i8").astype(np.int64)
    if buckets.size and (buckets.min() < 0 or buckets.max() >= num_buckets):
        raise EmbeddingError(f"bucket numbers must be in 0 .. {num_buckets - 1}")
    return buckets


def error_to_proto(error: EmbeddingError) -> pb.EmbeddingError:
    """The refusal as its message, with its kind (and the newer placement for NOT_OWNER)."""
    if isinstance(error, NotOwnerError):
        message = pb.EmbeddingError(message=str(error), kind=pb.EmbeddingError.NOT_OWNER)
        if error.newer is not None:
            message.map.CopyFrom(error.newer.to_proto())
        return message
    if isinstance(error, MovingError):
        return pb.EmbeddingError(message=str(error), kind=pb.EmbeddingError.MOVING)
    return pb.EmbeddingError(message=str(error))


def error_from_proto(message: pb.EmbeddingError) -> EmbeddingError:
    """The exception a refusal message stands for."""
    if message.kind == pb.EmbeddingError.NOT_OWNER:
        newer = Placement.from_proto(message.map) if message.HasField("map") else None
        return NotOwnerError(message.message, newer)
    if message.kind == pb.EmbeddingError.MOVING:
        return MovingError(message.message)
    return EmbeddingError(message.message)


def _encode_placement(placement: Placement) -> bytes:
    return placement.to_proto().SerializeToString()


def _decode_placement(raw: bytes) -> Placement:
    message = pb.BucketMapMessage()
    message.ParseFromString(raw)
    return Placement.from_proto(message)


PLACEMENT: KvChannel[Placement] = KvChannel(PS_PLACEMENT_KEY, _encode_placement, _decode_placement)
"""The embedding servers' placement: the master publishes it (each failover and resize), the
workers' `ElasticEmbedding` reads it."""
