"""The master over real gRPC on port 0: tokens, registration, rendezvous, KV, clear refusals."""

from __future__ import annotations

import math
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest

from dlrover.api.master import (
    HeartbeatReport,
    JoinRequest,
    NodeLimits,
    NodeOutcome,
    NodeReport,
    Registered,
    Registration,
)
from dlrover.client.master_client import (
    MasterClient,
    MasterRequestError,
    MasterUnreachableError,
    UnknownNodeError,
    UnsupportedCallError,
    WrongTokenError,
)
from dlrover.constants import MAX_KV_VALUE_BYTES
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.server import MasterServer, MasterServerError
from dlrover.master.state_store import MemoryStateStore
from tests.conftest import MasterProcess, clean_env

TOKEN = "secret-token"


@pytest.fixture
def server():
    s = MasterServer(
        JobMaster(JobMasterConfig(job_name="t"), MemoryStateStore()), TOKEN, "127.0.0.1", 0
    )
    s.start()
    yield s
    s.stop(0.1)


def client(server: MasterServer, token: str = TOKEN) -> MasterClient:
    return MasterClient(f"127.0.0.1:{server.port}", token, rpc_timeout_s=5)


def register(c: MasterClient, lo: int = 2, hi: int = 2, lws: int = 2) -> Registered:
    return c.register_node(
        Registration(host="127.0.0.1", local_world_size=lws, limits=NodeLimits(lo, hi, 1, 1))
    )


def test_wrong_or_missing_token_is_refused_and_changes_nothing(server):
    for bad in ("wrong", ""):
        with pytest.raises(WrongTokenError, match="DLROVER_JOB_TOKEN"):
            register(client(server, bad))
    assert server.job.members.nodes.all() == []
    with pytest.raises(WrongTokenError):
        client(server, "wrong").wait_ready(5)


def test_a_master_that_does_not_know_a_call_is_named_as_an_older_release() -> None:
    """A worker of a newer release than its master: gRPC's own answer ("Method not found!")
    said nothing of why."""
    from concurrent.futures import ThreadPoolExecutor

    older = grpc.server(ThreadPoolExecutor(1))  # serves no dlrover.Master call at all
    port = older.add_insecure_port("127.0.0.1:0")
    older.start()
    try:
        with pytest.raises(UnsupportedCallError, match="older DLRover release"):
            register(MasterClient(f"127.0.0.1:{port}", TOKEN, rpc_timeout_s=5))
    finally:
        older.stop(0)


def test_a_malformed_request_is_invalid_argument_naming_its_type_and_changes_nothing(server):
    """Found by benchmarks/protocol_fuzz.py: bytes that do not parse as the RPC's request came
    back as status UNKNOWN ("Unexpected DecodeError"), as if the master had a bug."""
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        register_raw = channel.unary_unary("/dlrover.Master/RegisterNode")
        for raw in (b"\x0a\xff\xff\xff\xff\x0f", b"\x0a\x05ab"):  # a huge length; truncated
            with pytest.raises(grpc.RpcError) as refused:
                register_raw(raw, metadata=(("x-dlrover-token", TOKEN),), timeout=5)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "malformed RegisterNodeRequest" in (refused.value.details() or "")
    assert server.job.members.nodes.all() == []
    assert register(client(server)).node_id  # and the master serves on


def test_a_wait_of_nan_seconds_is_refused_not_waited_for_ever(server):
    """Found by benchmarks/protocol_fuzz.py: a wait_s of NaN slipped through every bound
    (min(nan, 10) is nan) and held a thread of the master's pool without end."""
    from dlrover.proto import master_pb2 as pb

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        for method, request, reply in (
            ("CheckpointCommitted", pb.CheckpointCommittedRequest(step=1, wait_s=math.nan),
             pb.CheckpointCommittedResponse),
            ("KvGet", pb.KvGetRequest(key="k", wait_s=math.nan), pb.KvGetResponse),
        ):  # fmt: skip
            call = channel.unary_unary(
                f"/dlrover.Master/{method}",
                request_serializer=type(request).SerializeToString,
                response_deserializer=reply.FromString,
            )
            answer = call(request, metadata=(("x-dlrover-token", TOKEN),), timeout=5)
            assert (
                answer.refused.message == f"{method}: wait_s must be a number of seconds, got NaN"
            )
    assert client(server).kv_get("k") is None  # and the master serves on


def test_two_nodes_rendezvous_over_grpc(server):
    c = client(server)
    a, b = register(c), register(c)
    assert a.node_id != b.node_id and a.limits.max_nodes == 2
    r = c.join_rendezvous(JoinRequest(a.node_id, a.incarnation, 2, "h0", 11))
    assert not c.get_comm_world(a.node_id, r).complete
    c.join_rendezvous(JoinRequest(b.node_id, b.incarnation, 2, "h1", 12))
    wa, wb = c.get_comm_world(a.node_id, r), c.get_comm_world(b.node_id, r)
    assert wa.complete and wb.complete
    assert (wa.node_rank, wb.node_rank) == (0, 1)
    assert (wa.world_size, wb.rank_offset) == (4, 2)
    assert (wb.store_host, wb.store_port) == ("h0", 11)
    status = c.get_job_status()
    assert status.state == "running" and {n.state for n in status.nodes} == {"running"}


def test_conflicting_nnodes_and_unknown_node_get_clear_errors(server):
    c = client(server)
    register(c, 2, 2)
    with pytest.raises(MasterRequestError, match="--nnodes 1:4 .* the job has 2:2"):
        register(c, 1, 4)
    with pytest.raises(UnknownNodeError, match="unknown node 'nope'"):
        c.heartbeat(HeartbeatReport(node_id="nope", incarnation=0))
    with pytest.raises(MasterRequestError, match="local_world_size"):
        register(c, 2, 2, lws=0)


def test_stale_incarnation_is_fenced(server):
    c = client(server)
    first = register(c)
    again = c.register_node(Registration(host="h", local_world_size=2, node_id=first.node_id))
    assert again.incarnation == first.incarnation + 1
    with pytest.raises(MasterRequestError, match="stale"):
        c.heartbeat(HeartbeatReport(node_id=first.node_id, incarnation=first.incarnation))


def test_kv_get_waits_for_a_value_and_caps_sizes(server):
    c = client(server)
    got: list[bytes | None] = []
    t = threading.Thread(target=lambda: got.append(c.kv_get("k", wait_s=5)))
    t.start()
    assert server.job.kv.wait_for_readers("k", 1, timeout=5)  # the reader waits in the master
    c.kv_set("k", b"v")
    t.join(5)
    assert got == [b"v"]
    assert c.kv_get("absent", wait_s=0.05) is None
    with pytest.raises(MasterRequestError, match="limit"):
        c.kv_set("big", b"x" * (MAX_KV_VALUE_BYTES + 1))


def test_unreachable_master_fails_fast_naming_the_address():
    c = MasterClient("127.0.0.1:1", TOKEN)
    t0 = time.monotonic()
    with pytest.raises(MasterUnreachableError, match="127.0.0.1:1"):
        c.wait_ready(1.0)
    assert time.monotonic() - t0 < 5


def test_port_in_use_is_a_clear_error(server):
    with pytest.raises(MasterServerError, match="in use"):
        MasterServer(
            JobMaster(JobMasterConfig(), MemoryStateStore()), TOKEN, "127.0.0.1", server.port
        )


def test_job_succeeds_when_every_member_reports_success(server):
    c = client(server)
    nodes = [register(c) for _ in range(2)]
    for n in nodes:
        c.join_rendezvous(JoinRequest(n.node_id, n.incarnation, 2, "h", 1))
    for n in nodes:
        assert c.get_comm_world(n.node_id, 1).complete
    done = [
        c.report_node_status(NodeReport(n.node_id, n.incarnation, NodeOutcome.SUCCEEDED))
        for n in nodes
    ]
    assert done == [False, True]
    assert c.get_job_status().state == "succeeded"


def test_training_process_reports_its_step_through_the_env_client(server):
    node = register(client(server))
    env = {
        "DLROVER_MASTER_ADDR": f"127.0.0.1:{server.port}",
        "DLROVER_JOB_TOKEN": TOKEN,
        "DLROVER_NODE_ID": node.node_id,
    }
    trainer_client = MasterClient.from_env(env)
    trainer_client.report_step(41, rank=0, node_id=node.node_id)
    trainer_client.report_step(42, rank=1, node_id=node.node_id)
    [status] = client(server).get_job_status().nodes
    assert status.step == 42


def test_client_from_env_without_address_explains_what_to_do():
    with pytest.raises(Exception, match="DLROVER_MASTER_ADDR is not set"):
        MasterClient.from_env({})


def test_a_node_heard_again_after_being_lost_is_told_to_register_again():
    clock = [0.0]
    job = JobMaster(
        JobMasterConfig(heartbeat_timeout_s=5), MemoryStateStore(), clock=lambda: clock[0]
    )

    node = job.members.register_node(
        Registration("h", 2, "", "worker", -1, 1, limits=NodeLimits(1, 2, 1, 1.0))
    )
    first_incarnation = node.incarnation
    clock[0] = 6.0
    job.tick()
    assert job.members.nodes.get(node.node_id).state.value == "lost"
    assert (
        job.members.heartbeat(
            HeartbeatReport(
                node.node_id,
                node.incarnation,
                cpu_percent=0.0,
                memory_bytes=0,
                step=3,
                restart_count=0,
            )
        ).action
        == "reregister"
    )
    again = job.members.register_node(
        Registration("h", 2, node.node_id, "worker", -1, 1, limits=NodeLimits(1, 2, 1, 1.0))
    )
    assert again.incarnation == first_incarnation + 1
    assert job.members.nodes.get(again.node_id).state.value == "pending"


def test_failures_travel_both_ways_and_a_stale_agent_is_refused(server):
    from dlrover.api.errors import MasterRequestError
    from dlrover.api.master import FailureClass, FailureRecord

    c = client(server)
    me = register(c)
    record = FailureRecord(
        12.5, me.node_id, FailureClass.USER_ERROR, "restart_processes", "rank 1: ValueError", 2
    )
    c.report_failure(me.node_id, me.incarnation, record)
    assert c.get_failures() == (record,)
    with pytest.raises(MasterRequestError):
        c.report_failure(me.node_id, me.incarnation + 7, record)
    assert c.get_failures() == (record,)


@pytest.mark.parametrize("ending", ["idle", "sigterm"])
def test_a_bare_master_removes_its_temporary_state_when_it_ends(tmp_path: Path, ending: str):
    """Without --state-db the master keeps its state in a folder of its own under TMPDIR; it
    is gone once the master ended (no node in time, or a SIGTERM), as nothing resumes from it."""
    master = MasterProcess(tmp_path, "--idle-timeout", "3", env=clean_env(TMPDIR=str(tmp_path)))
    try:
        (state,) = tmp_path.glob("dlrover_master_*")
        assert (state / "state.db").exists()
        if ending == "sigterm":
            master.proc.send_signal(signal.SIGTERM)
        master.wait(60)
    finally:
        master.close()
    said = (tmp_path / "master.log").read_text()
    assert "no node registered" in said or "SIGTERM" in said, said
    assert not list(tmp_path.glob("dlrover_master_*")), said
