"""The typed interfaces are the one source of the master's RPCs (dlrover/api/rpc.py): every rpc
of the proto has its method, every implementation takes the interface's arguments by name, and
every refusal travels in the response with status OK."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import grpc
import pytest

from dlrover.api.master import MasterApi
from dlrover.api.rpc import REFUSED, SERVICE, interface_methods
from dlrover.api.sharding import ShardingTransport, StreamTransport
from dlrover.api.wire import RPCS
from dlrover.client.master_client import MasterClient
from dlrover.client.sharding import GrpcShardingTransport
from dlrover.constants import TOKEN_METADATA_KEY
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.local_api import LocalMasterApi
from dlrover.master.server import MasterServer
from dlrover.master.sharding_service import ShardingService
from dlrover.master.state_store import MemoryStateStore
from dlrover.proto import master_pb2 as pb
from dlrover.proto import master_pb2_grpc as pb_grpc
from dlrover.sharding.manager import ShardManager
from dlrover.testing.sharding import InProcessTransport

TOKEN = "t"


@pytest.fixture
def server() -> Iterator[MasterServer]:
    s = MasterServer(JobMaster(JobMasterConfig(), MemoryStateStore()), TOKEN, "127.0.0.1").start()
    yield s
    s.stop(0.1)


def test_every_rpc_of_the_proto_is_a_method_of_an_interface() -> None:
    assert {call.name for call in RPCS.values()} == set(SERVICE.methods_by_name)


@pytest.mark.parametrize(
    ("interface", "implementation"),
    [
        (MasterApi, LocalMasterApi),
        (ShardingTransport, ShardingService),
        (StreamTransport, ShardingService),
        (ShardingTransport, ShardManager),  # what InProcessTransport calls
    ],
    ids=lambda cls: cls.__name__,
)
def test_each_implementation_takes_the_interface_arguments_by_name(
    interface: type, implementation: type
) -> None:
    for method in interface_methods(interface):
        wanted = list(inspect.signature(getattr(interface, method)).parameters)
        have = list(inspect.signature(getattr(implementation, method)).parameters)
        assert have[: len(wanted)] == wanted, f"{implementation.__name__}.{method}"


@pytest.mark.parametrize("client", [MasterClient, GrpcShardingTransport, InProcessTransport])
def test_the_derived_clients_keep_the_interface_signatures(client: type) -> None:
    for method, call in RPCS.items():
        if hasattr(client, method):
            assert inspect.signature(getattr(client, method)) == call.signature, method


def test_every_response_can_carry_a_refusal() -> None:
    outputs = {m.output_type for m in SERVICE.methods}
    assert all(REFUSED in o.fields_by_name for o in outputs)


def test_a_refused_call_answers_ok_with_the_refusal_in_the_response(server: MasterServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = pb_grpc.MasterStub(channel)
        md = ((TOKEN_METADATA_KEY, TOKEN),)
        answer = stub.Heartbeat(pb.HeartbeatRequest(node_id="nope"), timeout=5, metadata=md)
        assert answer.refused.kind == pb.MasterError.UNKNOWN_NODE
        assert "unknown node 'nope'" in answer.refused.message
        bad = stub.ReportNodeStatus(
            pb.ReportNodeStatusRequest(node_id="nope", status="gone"), timeout=5, metadata=md
        )
        assert bad.refused.kind == pb.MasterError.REQUEST
        assert "unknown node outcome 'gone'" in bad.refused.message
        # Only a call that never reaches the API fails with a status.
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetJobStatus(pb.GetJobStatusRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
