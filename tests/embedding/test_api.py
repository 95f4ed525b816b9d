"""`EmbeddingServerApi` is the one source of the embedding server's RPCs (as the master's
interfaces are of its): every rpc of the proto has its method, the server implements each with
the interface's arguments, the client's typed calls keep its signatures, and a refusal raised on
the server arrives, inside the answer, as the same error on the client (gRPC on port 0)."""

from __future__ import annotations

import inspect

import grpc
import numpy as np
import pytest

from dlrover.api.rpc import interface_methods
from dlrover.constants import TOKEN_METADATA_KEY
from dlrover.embedding.api import RPCS, SERVICE, EmbeddingServerApi
from dlrover.embedding.buckets import BucketMap
from dlrover.embedding.client import EmbeddingClient, ServerCalls
from dlrover.embedding.server import EmbeddingServer, EmbeddingService
from dlrover.embedding.table import EmbeddingError
from dlrover.embedding.wire import MovingError, NotOwnerError, Placement
from dlrover.proto import embedding_pb2 as pb

TOKEN = "tok"


def test_every_rpc_of_the_proto_is_a_method_of_the_interface() -> None:
    assert sorted(call.name for call in RPCS.values()) == sorted(SERVICE.methods_by_name)
    assert {c.name for c in RPCS.values() if c.options.framed} == {"Lookup", "Push", "Replicate"}


def test_the_server_implements_and_the_client_keeps_every_signature() -> None:
    for method in interface_methods(EmbeddingServerApi):
        wanted = inspect.signature(getattr(EmbeddingServerApi, method))
        assert inspect.signature(getattr(EmbeddingService, method)) == wanted, method
        assert inspect.signature(getattr(ServerCalls, method)) == RPCS[method].signature, method
        if RPCS[method].options.framed:
            assert callable(getattr(EmbeddingService, f"{method}_frames")), method


def test_typed_calls_reach_the_server_and_refusals_come_back_as_their_class(
    server: EmbeddingServer,
) -> None:
    client = EmbeddingClient([server.address], TOKEN, BucketMap.even(1, 8), timeout_s=5.0)
    try:
        calls = client.server(server.address)
        spec = pb.TableSpec(name="t", dim=2, optimizer="sgd", lr=0.5)
        assert calls.create_table(spec) is True and calls.create_table(spec) is False
        with pytest.raises(EmbeddingError, match="exists with another spec"):
            calls.create_table(pb.TableSpec(name="t", dim=3))
        ids = np.array([3, 5], dtype="<i8").tobytes()
        looked = calls.lookup("t", ids)
        assert looked.dim == 2 and len(looked.rows) == 2 * 2 * 4
        grads = np.ones((2, 2), dtype="<f4").tobytes()
        assert calls.push("t", ids, grads, "me", 1).applied == 2
        assert calls.push("t", ids, grads, "me", 1).duplicate  # the same number again
        assert calls.applied_pushes("me", "t").seqs == [1]
        assert calls.get_placement() is None  # no map yet
        assert calls.get_data_port() == server.service.data_port > 0
        assert [t.name for t in calls.stats().tables] == ["t"]

        # A map that gives every bucket to another server: this one is no owner any more.
        owners = BucketMap(2, (1,) * 8)
        placement = Placement(owners, ("elsewhere:1", server.address))
        calls.set_map(placement.to_proto(), index=1)
        assert calls.get_placement() == placement.to_proto()
        calls.set_map(
            Placement(BucketMap(3, (0,) * 8), ("elsewhere:1", server.address)).to_proto(), 1
        )
        with pytest.raises(NotOwnerError) as refused:
            calls.lookup("t", ids)
        assert refused.value.newer is not None and refused.value.newer.map.version == 3
        frozen = np.arange(8, dtype="<i8").tobytes()
        calls.set_map(Placement(BucketMap(4, (0,) * 8), (server.address,)).to_proto(), 0, frozen)
        with pytest.raises(MovingError):
            calls.push("t", ids, grads, "me", 2)
    finally:
        client.close()


def test_a_request_missing_a_message_it_needs_is_refused_by_name(server: EmbeddingServer) -> None:
    with grpc.insecure_channel(server.address) as channel:
        set_map = channel.unary_unary(
            f"/{SERVICE.full_name}/SetMap", response_deserializer=pb.SetMapResponse.FromString
        )
        answer = set_map(b"", metadata=((TOKEN_METADATA_KEY, TOKEN),), timeout=5)
    assert "SetMapRequest has no 'map': it is required" in answer.error.message
