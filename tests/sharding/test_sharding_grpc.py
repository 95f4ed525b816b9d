"""The master's sharding RPCs over real gRPC on port 0: typed refusals, malformed requests, restart."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from dlrover.client.master_client import MasterClient, MasterRequestError, MasterUnreachableError
from dlrover.client.sharding import GrpcShardingTransport
from dlrover.client.sharding_transport import ShardingTransport
from dlrover.constants import TOKEN_METADATA_KEY
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.server import MasterServer
from dlrover.master.state_store import MemoryStateStore, StateStore
from dlrover.proto import master_pb2 as pb
from dlrover.sharding import errors
from dlrover.sharding.manager import ShardManager
from dlrover.sharding.types import ConsumptionMark, DatasetSpec, Position, ShardId
from dlrover.testing.sharding import InProcessTransport

TOKEN = "t"


def start_server(store: StateStore | None = None) -> MasterServer:
    job = JobMaster(JobMasterConfig(job_name="t"), store or MemoryStateStore())
    return MasterServer(job, TOKEN, "127.0.0.1", 0).start()


@pytest.fixture
def server() -> Iterator[MasterServer]:
    s = start_server()
    yield s
    s.stop(0.1)


def master_client(server: MasterServer) -> MasterClient:
    return MasterClient(f"127.0.0.1:{server.port}", TOKEN, rpc_timeout_s=5)


def refusals(
    transport: ShardingTransport, lose_node_0: Callable[[], object]
) -> list[tuple[type[Exception], str]]:
    """Every refusal the master can give, in order: (class, message) of each."""
    transport.register_dataset(DatasetSpec("d", size=100, shard_size=10, max_retries=0))
    assert transport.fetch_shards("d", "n0/0", 1).shards
    lose_node_0()  # its shard may not be handed out again: the dataset fails
    calls: list[Callable[[], object]] = [
        lambda: transport.get_position("DatasetConflictError: not a class name"),
        lambda: transport.register_dataset(DatasetSpec("d", size=10, shard_size=10)),
        lambda: transport.fetch_shards("d", "n1/0", 0),
        lambda: transport.mark_consumption("d", "n1/0", ConsumptionMark(0, 0, ShardId(0, 99))),
        lambda: transport.restore_position(Position("d", epoch=0, cursor=11), "step3"),
        lambda: transport.fetch_shards("d", "n1/0", 1),
    ]
    seen: list[tuple[type[Exception], str]] = []
    for call in calls:
        with pytest.raises(errors.ShardingError) as refused:
            call()
        seen.append((type(refused.value), str(refused.value)))
    return seen


def test_every_refusal_reaches_the_client_as_the_class_and_message_the_master_raised(
    server: MasterServer,
) -> None:
    over_grpc = refusals(
        GrpcShardingTransport(master_client(server)),
        lambda: server.job.sharding.recover_node("n0"),
    )
    in_process = InProcessTransport(ShardManager())
    oracle = refusals(in_process, lambda: in_process.recover_worker("n0/0"))
    assert over_grpc == oracle
    assert [cls for cls, _ in over_grpc] == [
        errors.UnknownDatasetError,  # a class name in the message changes nothing
        errors.DatasetConflictError,
        errors.InvalidSpecError,
        errors.InvalidSpecError,
        errors.InvalidPositionError,
        errors.ShardRetriesExhaustedError,
    ]


def test_a_refusal_travels_in_the_typed_error_field_with_an_ok_status(server: MasterServer) -> None:
    client = master_client(server)
    response = client.call(client.stub.GetPosition, pb.GetPositionRequest(dataset="missing"))
    assert response.WhichOneof("outcome") == "error"
    assert response.error.kind == pb.ShardingError.UNKNOWN_DATASET
    assert "dataset 'missing' is not registered" in response.error.message
    spec = pb.DatasetSpec(name="d", size=10, shard_size=10, epochs=0)
    registered = client.call(client.stub.RegisterDataset, pb.RegisterDatasetRequest(spec=spec))
    assert registered.error.kind == pb.ShardingError.INVALID_SPEC
    assert "epochs must be >= 1" in registered.error.message


def test_a_malformed_request_is_refused_with_invalid_argument_and_changes_nothing(
    server: MasterServer,
) -> None:
    client = master_client(server)
    spec = pb.DatasetSpec(name="d", size=10, shard_size=10)
    malformed: list[tuple[Callable[[], object], str]] = [
        (
            lambda: client.call(client.stub.RegisterDataset, pb.RegisterDatasetRequest()),
            "RegisterDatasetRequest has no 'spec'",
        ),
        (
            lambda: client.call(
                client.stub.RegisterDataset,
                pb.RegisterDatasetRequest(spec=pb.DatasetSpec(name="d", size=10, mode=5)),  # type: ignore[arg-type]
            ),
            "unknown delivery mode 5",
        ),
        (
            lambda: client.call(
                client.stub.ReportProgress, pb.ReportProgressRequest(dataset="d", worker_id="w")
            ),
            "ReportProgressRequest has no 'shard_id'",
        ),
        (
            lambda: client.call(
                client.stub.MarkConsumption, pb.MarkConsumptionRequest(dataset="d", worker_id="w")
            ),
            "MarkConsumptionRequest has no 'mark'",
        ),
        (
            lambda: client.call(client.stub.RestorePosition, pb.RestorePositionRequest(token="x")),
            "RestorePositionRequest has no 'position'",
        ),
    ]
    client.call(client.stub.RegisterDataset, pb.RegisterDatasetRequest(spec=spec))
    before = server.job.sharding.manager.to_state()
    for call, message in malformed:
        with pytest.raises(MasterRequestError, match=message):
            call()
    assert server.job.sharding.manager.to_state() == before


def test_an_unknown_call_is_unimplemented(server: MasterServer) -> None:
    """E.g. the JSON `Sharding` call of older clients, which this master no longer serves."""
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = channel.unary_unary("/dlrover.Master/Sharding")
        with pytest.raises(grpc.RpcError) as refused:
            call(b"", timeout=5, metadata=((TOKEN_METADATA_KEY, TOKEN),))
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_restarted_master_keeps_what_changing_calls_saved() -> None:
    store = MemoryStateStore()
    spec = DatasetSpec("d", size=100, shard_size=10)
    first = start_server(store)
    try:
        transport = GrpcShardingTransport(master_client(first))
        transport.register_dataset(spec)
        held = transport.fetch_shards("d", "n0/0", 3).shards
        transport.report_done("d", "n0/0", [held[0].id])
        position = transport.get_position("d")
    finally:
        first.stop(0.1)
    second = start_server(store)
    try:
        transport = GrpcShardingTransport(master_client(second))
        assert not transport.register_dataset(spec).created
        assert transport.get_position("d") == position
        progress = transport.dataset_progress("d")
        assert (progress.leased, progress.done_shards) == (2, 1)
    finally:
        second.stop(0.1)


def test_a_call_made_while_the_master_restarts_is_answered_by_the_restarted_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker's mark during a master restart (the fault campaign's master_kill: the worker
    failed with MasterUnreachableError) waits for the master that comes back on the same port
    and state, instead of failing the worker."""
    store = MemoryStateStore()
    spec = DatasetSpec("d", size=100, shard_size=10)
    first = start_server(store)
    port = first.port
    transport = GrpcShardingTransport(master_client(first))
    transport.register_dataset(spec)
    [shard] = transport.fetch_shards("d", "n0/0", 1).shards
    first.stop(0.1)
    caplog.set_level(logging.WARNING, "dlrover.api.retry")
    done = threading.Event()
    failed: list[BaseException] = []

    def mark() -> None:
        try:
            transport.mark_consumption("d", "n0/0", ConsumptionMark(0, 0, shard.id, 0))
        except BaseException as exc:  # reaches the assertion below
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=mark, daemon=True).start()
    deadline = time.monotonic() + 30
    while "sharding call MarkConsumption: the master does not answer" not in caplog.text:
        assert not done.is_set(), failed  # it must wait, not fail
        assert time.monotonic() < deadline, "the mark never found the master gone"
        time.sleep(0.02)  # the warning is logged by the caller's thread: nothing to await
    job = JobMaster(JobMasterConfig(job_name="t"), store)
    second = MasterServer(job, TOKEN, "127.0.0.1", port).start()
    try:
        assert done.wait(30) and not failed, failed
        transport.report_done("d", "n0/0", [shard.id])  # the restarted master has its lease
        assert transport.dataset_progress("d").done_shards == 1
    finally:
        second.stop(0.1)


def test_a_master_gone_past_the_reconnect_window_is_a_clear_error() -> None:
    first = start_server()
    transport = GrpcShardingTransport(master_client(first), reconnect_s=1.0)
    transport.register_dataset(DatasetSpec("d", size=100, shard_size=10))
    first.stop(0.1)
    started = time.monotonic()
    with pytest.raises(MasterUnreachableError, match="master at 127.0.0.1.* did not answer"):
        transport.get_position("d")
    assert time.monotonic() - started < 30
