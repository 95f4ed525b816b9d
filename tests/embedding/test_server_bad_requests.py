"""An embedding server (gRPC on port 0) refuses malformed and impossible requests with a clear
error and serves on: each case here was found by benchmarks/protocol_fuzz.py."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from dlrover.embedding.buckets import BucketMap
from dlrover.embedding.client import EmbeddingClient
from dlrover.embedding.server import EmbeddingServer
from dlrover.embedding.table import EmbeddingError
from dlrover.embedding.wire import Placement
from dlrover.proto import embedding_pb2 as pb

TOKEN = "tok"
IDS = np.array([1, 2, 3], dtype=np.int64)


@pytest.fixture
def client(server: EmbeddingServer) -> Iterator[EmbeddingClient]:
    c = EmbeddingClient([server.address], TOKEN, BucketMap.even(1, 8), timeout_s=5.0)
    c.create_table(pb.TableSpec(name="t", dim=4, optimizer="sgd", lr=0.1))
    try:
        yield c
    finally:
        c.close()


def test_a_request_that_does_not_parse_is_invalid_argument(server: EmbeddingServer) -> None:
    """It was INTERNAL "Exception deserializing request!", which names neither side's fault."""
    with grpc.insecure_channel(server.address) as channel:
        lookup = channel.unary_unary("/dlrover.embedding.EmbeddingServer/Lookup")
        with pytest.raises(grpc.RpcError) as refused:
            lookup(b"\x0a\xff\xff\xff\xff\x0f", metadata=(("x-dlrover-token", TOKEN),), timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed LookupRequest" in (refused.value.details() or "")


def _set_map(client: EmbeddingClient, server: EmbeddingServer, **fields: object) -> None:
    request = pb.SetMapRequest(map=Placement(BucketMap.even(1, 8), (server.address,)).to_proto())
    for name, value in fields.items():
        if name == "map":
            request.map.CopyFrom(value)  # type: ignore[arg-type]
        else:
            setattr(request, name, value)
    client.call(server.address, "SetMap", request)


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        # Owners of nobody: every lookup after it failed with IndexError (status UNKNOWN).
        ({"map": pb.BucketMapMessage(version=1)}, "one int32 owner per bucket"),
        (
            {"map": pb.BucketMapMessage(version=1, owners=b"\x05\x00\x00\x00", addresses=["a"])},
            "owners 5 .. 5 but has 1 addresses",
        ),
        ({"frozen": np.array([8], dtype="<i8").tobytes()}, r"bucket numbers must be in 0 \.\. 7"),
        ({"frozen": b"\x01\x02\x03"}, "buckets must be int64s"),
        ({"index": 3}, "server index 3 is not in the map's 1 servers"),
        ({"replica": 99}, "unknown replica mode 99"),
    ],
)
def test_an_impossible_map_is_refused_and_the_old_one_serves_on(
    client: EmbeddingClient, server: EmbeddingServer, fields: dict[str, object], error: str
) -> None:
    before = client.lookup("t", IDS, 4)
    with pytest.raises(EmbeddingError, match=error):
        _set_map(client, server, **fields)
    np.testing.assert_array_equal(client.lookup("t", IDS, 4), before)


def test_rows_whose_sizes_do_not_fit_and_absurd_tables_are_refused(
    client: EmbeddingClient, server: EmbeddingServer
) -> None:
    before = client.lookup("t", IDS, 4)
    short = pb.RowsMessage(table="t", ids=IDS.tobytes(), rows=b"\x00" * 16, accum=b"\x00" * 16)
    for method in ("ImportRows", "Replicate"):  # a reshape ValueError came back as UNKNOWN
        short.spec.CopyFrom(pb.TableSpec(name="t", dim=4))
        with pytest.raises(EmbeddingError, match="3 rows of 4 float32 values are 48 bytes"):
            client.call(server.address, method, short)
    bad_buckets = pb.BucketsRequest(table="t", buckets=b"\x01", num_buckets=0)
    for method in ("ExportBuckets", "DropBuckets", "ExportReplica"):
        with pytest.raises(EmbeddingError, match="buckets must be int64s"):
            client.call(server.address, method, bad_buckets)
    huge = pb.CreateTableRequest(spec=pb.TableSpec(name="huge", dim=2**31 - 1))
    with pytest.raises(EmbeddingError, match=r"dim must be 1 \.\. 65536"):  # was MemoryError
        client.call(server.address, "CreateTable", huge)
    np.testing.assert_array_equal(client.lookup("t", IDS, 4), before)
