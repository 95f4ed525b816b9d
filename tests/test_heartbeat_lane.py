"""Heartbeats on a server of their own (`HeartbeatLane`), over real gRPC on port 0: the master
names it in every heartbeat reply, it answers while the master's loop is busy, it checks the
token and serves nothing else, and a node that cannot reach it beats at the master's address."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import pytest

from dlrover.api.master import HeartbeatReport, NodeLimits, Registration
from dlrover.client.master_client import MasterClient, UnsupportedCallError, WrongTokenError
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.server import MasterServer, MasterServerError
from dlrover.master.state_store import MemoryStateStore

TOKEN = "lane-token"


def start(heartbeat_port: int | None = 0) -> MasterServer:
    job = JobMaster(JobMasterConfig(job_name="lane"), MemoryStateStore())
    return MasterServer(job, TOKEN, "127.0.0.1", 0, heartbeat_port=heartbeat_port).start()


@pytest.fixture
def server():
    s = start()
    yield s
    s.stop(0.1)


def registered(server: MasterServer) -> tuple[MasterClient, HeartbeatReport]:
    client = MasterClient(f"127.0.0.1:{server.port}", TOKEN, rpc_timeout_s=5)
    node = client.register_node(
        Registration(host="127.0.0.1", local_world_size=1, limits=NodeLimits(1, 1, 1, 1))
    )
    return client, HeartbeatReport(node.node_id, node.incarnation)


def hold_loop(server: MasterServer) -> threading.Event:
    """Hold the asyncio server's loop until the returned event is set: every call of the
    master's own address waits meanwhile."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(30)

    server._loop.call_soon_threadsafe(hold)
    assert held.wait(10)
    return release


def test_a_heartbeat_is_answered_while_the_master_s_loop_is_held(server):
    client, report = registered(server)
    assert server.heartbeat_port not in (0, server.port)
    first = client.heartbeat(report)  # to the master's address: the reply names the lane
    assert first.heartbeat_port == server.heartbeat_port

    release = hold_loop(server)
    try:
        second = client.heartbeat(report)  # answered by the lane, the loop still held
        assert not release.is_set()
        assert second.heartbeat_port == server.heartbeat_port
        assert second.job_state == first.job_state
    finally:
        release.set()
    node = server.job.members.nodes.get(report.node_id)
    assert node.last_heartbeat > 0


def test_the_lane_checks_the_token_and_serves_heartbeats_only(server):
    _, report = registered(server)
    lane = f"127.0.0.1:{server.heartbeat_port}"
    with pytest.raises(WrongTokenError):
        MasterClient(lane, "wrong", rpc_timeout_s=5).heartbeat(report)
    with pytest.raises(UnsupportedCallError):
        MasterClient(lane, TOKEN, rpc_timeout_s=5).get_job_status()
    assert MasterClient(lane, TOKEN, rpc_timeout_s=5).heartbeat(report).job_state


def test_a_lane_that_does_not_answer_sends_heartbeats_to_the_master_s_address(server, caplog):
    client, report = registered(server)
    client.heartbeat(report)
    client.heartbeat(report)  # on the lane
    server._lane.stop(0).wait(5)  # the lane is gone (a port the network does not pass)
    with caplog.at_level(logging.WARNING, logger="dlrover.client.master_client"):
        reply = client.heartbeat(report)  # the lane refuses; the same beat goes to the address
    assert reply.heartbeat_port == server.heartbeat_port
    assert f"heartbeat server at 127.0.0.1:{server.heartbeat_port} failed" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dlrover.client.master_client"):
        client.heartbeat(report)  # not tried again so soon: no second warning
    assert "failed a heartbeat" not in caplog.text
    client.close()
    deadline = time.monotonic() + 10  # the stopped lane's threads end
    while [t for t in threading.enumerate() if t.name.startswith("dlrover-master-beat")]:
        assert time.monotonic() < deadline, "the heartbeat server's threads outlived it"
        time.sleep(0.01)


def test_a_lane_port_another_job_s_master_took_sends_heartbeats_home(server):
    """The master restarted on a new heartbeat port, and another job's master took the old
    one: its wrong-token refusal is the port's failure, not this master's."""
    client, report = registered(server)
    client.heartbeat(report)
    stranger = MasterServer(
        JobMaster(JobMasterConfig(job_name="other"), MemoryStateStore()), "other-token", "127.0.0.1"
    ).start()
    try:
        client._follow_lane(stranger.port)  # as a reply naming the old port would have
        reply = client.heartbeat(report)  # refused there (token): sent home at once
        assert reply.heartbeat_port == server.heartbeat_port
        release = hold_loop(server)  # the stranger's port is not tried again: the lane is
        try:
            assert client.heartbeat(report).heartbeat_port == server.heartbeat_port
        finally:
            release.set()
    finally:
        stranger.stop(0.1)
        client.close()


def test_without_a_lane_heartbeats_stay_on_the_master_s_address():
    server = start(heartbeat_port=None)
    try:
        client, report = registered(server)
        assert server.heartbeat_port == 0
        assert client.heartbeat(report).heartbeat_port == 0
        assert client.heartbeat(report).heartbeat_port == 0
    finally:
        server.stop(0.1)


def test_a_taken_heartbeat_port_is_refused_by_name(server):
    with pytest.raises(MasterServerError, match="--heartbeat-port"):
        start(heartbeat_port=server.heartbeat_port)


def test_a_restarted_master_s_new_heartbeat_port_is_followed(server):
    client, report = registered(server)
    client.heartbeat(report)
    client.heartbeat(report)  # on the first master's lane
    job, port = server.job, server.port
    server.stop(0.1)
    again = MasterServer(job, TOKEN, "127.0.0.1", port, heartbeat_port=0).start()
    try:
        # The old lane is gone: the beat goes to the address, whose reply names the new lane.
        assert client.heartbeat(report).heartbeat_port == again.heartbeat_port
        release = hold_loop(again)
        try:
            assert client.heartbeat(report).heartbeat_port == again.heartbeat_port
        finally:
            release.set()
    finally:
        again.stop(0.1)


def _stop_while_flooded() -> bool:
    """Start a lane whose heartbeats take 20 ms each, pour calls into it from 4 threads (they
    queue up in its pool), stop it; whether `stop` returned within 5 s."""
    import grpc

    from dlrover.constants import TOKEN_METADATA_KEY
    from dlrover.master.server import SERVICE, HeartbeatLane
    from dlrover.proto import master_pb2 as pb

    class Slow:
        def sync_handler(self, call):
            def handle(request, context):
                time.sleep(0.02)
                return pb.HeartbeatResponse()

            return handle

    lane = HeartbeatLane(TOKEN, "127.0.0.1", 0)
    lane.start(Slow())  # type: ignore[arg-type]
    channel = grpc.insecure_channel(f"127.0.0.1:{lane.port}")
    beat = channel.unary_unary(
        f"/{SERVICE.full_name}/Heartbeat",
        request_serializer=pb.HeartbeatRequest.SerializeToString,
        response_deserializer=pb.HeartbeatResponse.FromString,
    )
    pour = threading.Event()

    def flood() -> None:
        while not pour.is_set():
            with contextlib.suppress(ValueError):  # the channel closed at the end
                beat.future(
                    pb.HeartbeatRequest(), metadata=((TOKEN_METADATA_KEY, TOKEN),), timeout=5
                )
            time.sleep(0.0005)

    floods = [threading.Thread(target=flood, daemon=True) for _ in range(4)]
    for t in floods:
        t.start()
    time.sleep(0.3)
    returned = threading.Event()

    def stop() -> None:
        lane.stop(0)
        returned.set()

    threading.Thread(target=stop, daemon=True).start()
    done = returned.wait(5)
    pour.set()
    for t in floods:
        t.join(5)
    channel.close()
    return done


def test_a_lane_stopped_while_heartbeats_pour_in_stops_at_once_and_its_threads_end():
    """Stopping the lane while calls arrive faster than its two threads answer them (a master
    that ends while every node beats): `stop` returns at once and the lane's threads end. Its
    pool was shut down beside grpc's serving thread, and the two took each other's lock: 10 of
    20 such stops hung (a master at 20,000 nodes never exited)."""
    for attempt in range(8):
        assert _stop_while_flooded(), f"stop {attempt + 1} hung"
    deadline = time.monotonic() + 10
    while [t for t in threading.enumerate() if t.name.startswith("dlrover-master-beat")]:
        assert time.monotonic() < deadline, "the stopped lanes' threads outlived them"
        time.sleep(0.01)
