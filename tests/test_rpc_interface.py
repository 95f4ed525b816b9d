"""The typed interfaces are the one source of the master's RPCs (dlrover/api/rpc.py): every rpc
of the proto has its method, every implementation takes the interface's arguments by name, and
every refusal travels in the response with status OK."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Protocol

import grpc
import pytest

from dlrover.api.master import MASTER_PARTS, MasterApi
from dlrover.api.rpc import REFUSED, SERVICE, Run, interface_methods
from dlrover.api.sharding import ShardingTransport
from dlrover.api.wire import RPCS
from dlrover.client.master_client import MasterClient
from dlrover.client.sharding import GrpcShardingTransport
from dlrover.constants import TOKEN_METADATA_KEY
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.local_api import LocalMasterApi
from dlrover.master.server import MasterServer
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


_SERVED = JobMaster(JobMasterConfig(), MemoryStateStore()).services()
"""Which part of a master serves each interface: the servicer and LocalMasterApi call it so."""


@pytest.mark.parametrize(
    ("interface", "implementation"),
    [
        *((i, type(part)) for i, part in _SERVED.items()),
        (ShardingTransport, ShardManager),  # what InProcessTransport calls
    ],
    ids=lambda cls: cls.__name__,
)
def test_each_implementation_takes_the_interface_arguments_by_name(
    interface: type, implementation: type
) -> None:
    """The part serving an interface takes each method's arguments by name (they come by name,
    decoded from a request), and a long poll's method takes them all but ``wait_s``."""
    for method in interface_methods(interface):
        wanted = list(inspect.signature(getattr(interface, method)).parameters)
        options = RPCS[method].options
        if options.run is Run.POLL:
            method, wanted = options.poll, [p for p in wanted if p != "wait_s"]
        have = list(inspect.signature(getattr(implementation, method)).parameters)
        assert have[: len(wanted)] == wanted, f"{implementation.__name__}.{method}"


def test_every_part_interface_is_served_and_makes_up_the_master_api() -> None:
    assert set(_SERVED) >= set(MASTER_PARTS) and set(MASTER_PARTS) == set(MasterApi.__bases__) - {
        Protocol
    }
    assert {m for i in MASTER_PARTS for m in interface_methods(i)} == {
        m for m, call in RPCS.items() if call.interface in MASTER_PARTS
    }
    assert all(hasattr(LocalMasterApi, m) for i in MASTER_PARTS for m in interface_methods(i))


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
