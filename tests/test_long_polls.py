"""The master's long polls over real gRPC on port 0: a held call answers the moment its answer
changes (round closed, world must re-form, job ended), and only then; and the master holds
thousands of calls at once without dropping any."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from dlrover.agent.rendezvous_client import MembershipWatch
from dlrover.api.errors import MasterUnreachableError
from dlrover.api.master import (
    HeartbeatReport,
    JoinRequest,
    NodeLimits,
    NodeOutcome,
    NodeReport,
    Registration,
)
from dlrover.client.master_client import MasterClient
from dlrover.constants import TOKEN_METADATA_KEY
from dlrover.master.job import JobMaster, JobMasterConfig, JobState
from dlrover.master.local_api import LocalMasterApi
from dlrover.master.nodes import NodeState
from dlrover.master.rendezvous import RendezvousConfig
from dlrover.master.server import MasterServer
from dlrover.master.state_store import MemoryStateStore
from dlrover.proto import master_pb2 as pb
from dlrover.proto import master_pb2_grpc as pb_grpc

TOKEN = "t"
HELD = 20.0
"""What the tests ask the master to hold: far longer than any answer may take."""


@pytest.fixture
def server() -> Iterator[MasterServer]:
    s = MasterServer(
        JobMaster(JobMasterConfig(job_name="j"), MemoryStateStore()), TOKEN, "127.0.0.1"
    )
    s.start()
    yield s
    s.stop(0.1)


def _client(server: MasterServer) -> MasterClient:
    return MasterClient(f"127.0.0.1:{server.port}", TOKEN, rpc_timeout_s=5)


def _node(c: MasterClient, nodes: int, least: int = 0) -> tuple[str, int]:
    limits = NodeLimits(least or nodes, nodes, 1, 0.5)
    r = c.register_node(Registration("127.0.0.1", 1, limits=limits))
    return r.node_id, r.incarnation


def _join(c: MasterClient, node: tuple[str, int]) -> int:
    return c.join_rendezvous(JoinRequest(node[0], node[1], 1, "127.0.0.1", 1))


def _timed(fn: Callable[[], Any]) -> tuple[threading.Thread, list[tuple[Any, float]]]:
    """Run ``fn`` in a thread; the list gets (result, seconds it took)."""
    out: list[tuple[Any, float]] = []

    def run() -> None:
        start = time.monotonic()
        out.append((fn(), time.monotonic() - start))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_node_waiting_for_its_round_hears_the_moment_the_last_node_joins(server):
    c = _client(server)
    a, b = _node(c, 2), _node(c, 2)
    round_a = _join(c, a)
    thread, out = _timed(lambda: c.get_comm_world(a[0], round_a, HELD))
    time.sleep(0.3)  # a's call is held: nothing to answer yet
    assert thread.is_alive()
    _join(c, b)
    thread.join(HELD)
    ((world, took),) = out
    assert world.complete and world.round == 1 and world.num_nodes == 2
    assert 0.3 <= took < 3.0  # answered by b's join, not by the end of the hold


def test_an_incomplete_round_is_answered_when_the_hold_ends(server):
    c = _client(server)
    a = _node(c, 2)
    round_a = _join(c, a)
    start = time.monotonic()
    world = c.get_comm_world(a[0], round_a, 0.5)
    assert not world.complete and not world.rejoin
    assert 0.4 <= time.monotonic() - start < 3.0


def test_the_membership_watch_answers_when_a_node_joins_and_when_the_job_ends(server):
    c = _client(server)
    a, b = _node(c, 2, least=1), _node(c, 2, least=1)
    round_a = _join(c, a)
    # 1..2 nodes: a alone forms round 1 when the last call (0.5 s) ends, within the held call.
    start = time.monotonic()
    first = c.get_comm_world(a[0], round_a, HELD)
    assert first.complete and first.round == 1 and first.num_nodes == 1
    assert time.monotonic() - start < 3.0
    thread, out = _timed(lambda: c.num_nodes_waiting(a[0], 1, HELD))
    time.sleep(0.3)
    assert thread.is_alive()  # nothing changed: the watch is held
    _join(c, b)  # b wants in: a's world must re-form
    thread.join(HELD)
    ((waiting, took),) = out
    assert waiting.waiting == 1 and not waiting.job_ended and took < 3.0

    _join(c, a)  # a re-forms: with b, max nodes, round 2 closes on this join
    assert c.get_comm_world(a[0], 2, HELD).num_nodes == 2
    thread, out = _timed(lambda: c.num_nodes_waiting(a[0], 2, HELD))
    time.sleep(0.3)
    assert thread.is_alive()
    c.stop_job("stopped by the test")
    thread.join(HELD)
    ((waiting, took),) = out
    assert waiting.job_ended and took < 3.0


def test_the_exit_barrier_is_held_until_the_last_node_succeeds(server):
    c = _client(server)
    a, b = _node(c, 2), _node(c, 2)
    for n in (a, b):
        _join(c, n)
    assert c.get_comm_world(a[0], 1, HELD).complete
    thread, out = _timed(
        lambda: c.report_node_status(NodeReport(a[0], a[1], NodeOutcome.SUCCEEDED), HELD)
    )
    time.sleep(0.3)
    assert thread.is_alive()  # b still runs
    assert c.report_node_status(NodeReport(b[0], b[1], NodeOutcome.SUCCEEDED), HELD)
    thread.join(HELD)
    ((done, took),) = out
    assert done and took < 3.0
    assert server.job.lifecycle.state is JobState.SUCCEEDED
    # The barrier's status read leaves the node list out.
    assert c.get_job_status(with_nodes=False).nodes == ()
    assert len(c.get_job_status().nodes) == 2


def test_thousands_of_calls_at_once_are_all_answered(server):
    """gRPC cancels calls beyond ~1,000 waiting for the loop unless the server raises its
    pending-call limit: 3,000 nodes registering at once must all get an answer."""
    n = 3000

    async def burst() -> list[Any]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.MasterStub(channel)
            md = ((TOKEN_METADATA_KEY, TOKEN),)
            limits = pb.JobConfig(min_nodes=n, max_nodes=n, node_unit=1, last_call_timeout_s=1)
            calls = [
                stub.RegisterNode(
                    pb.RegisterNodeRequest(host="h", local_world_size=1, pid=i, config=limits),
                    timeout=60,
                    metadata=md,
                )
                for i in range(n)
            ]
            return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(burst())
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} of {n} calls failed, e.g. {failed[0]!r}"
    assert len({r.node_id for r in results}) == n == len(server.job.members.nodes)


def test_heartbeats_stretch_with_the_job_and_a_shrinking_job_keeps_its_nodes():
    now = [0.0]
    job = JobMaster(
        JobMasterConfig(
            rendezvous=RendezvousConfig(1, 100), heartbeat_timeout_s=6.0, heartbeats_per_s=2.0
        ),
        MemoryStateStore(),
        clock=lambda: now[0],
    )
    api = LocalMasterApi(job)
    nodes = [api.register_node(Registration("h", 1)) for _ in range(40)]
    # 40 live nodes at 2 beats/s: each beats every 20 s, and is lost after 3 of those.
    assert nodes[-1].heartbeat_interval_s == pytest.approx(20.0)
    assert job.members.heartbeat_timeout_s() == pytest.approx(60.0)
    # 30 nodes end: new answers say 5 s, but nodes told 20 s must not be lost at 15 s of silence.
    for n in nodes[:30]:
        job.members.nodes.set_state(n.node_id, NodeState.SUCCEEDED, "done")
    assert job.members.heartbeat_interval_s() == pytest.approx(5.0)
    now[0] = 30.0
    job.tick()
    assert all(job.members.nodes.get(n.node_id).state == NodeState.PENDING for n in nodes[30:])
    # Once every node has beaten again (2 high intervals later) the timeout comes down, by halves.
    now[0] = 45.0
    for n in nodes[30:]:
        api.heartbeat(HeartbeatReport(n.node_id, n.incarnation))
    assert job.members.heartbeat_timeout_s() == pytest.approx(30.0)


def test_the_agents_membership_watch_flags_only_the_round_it_watched():
    job = JobMaster(JobMasterConfig(rendezvous=RendezvousConfig(1, 2)), MemoryStateStore())
    api = LocalMasterApi(job)
    a, b = (api.register_node(Registration("h", 1)) for _ in range(2))
    api.join_rendezvous(JoinRequest(a.node_id, a.incarnation, 1, "h", 1))
    world = api.get_comm_world(a.node_id, 1, HELD)
    assert world.complete and world.round == 1
    stop = threading.Event()
    watch = MembershipWatch(api, stop, wait_s=HELD)
    watch.arm(a.node_id, 1)
    try:
        time.sleep(0.2)
        assert not watch.must_reform(1)
        api.join_rendezvous(JoinRequest(b.node_id, b.incarnation, 1, "h", 1))
        deadline = time.monotonic() + 5
        while not watch.must_reform(1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.must_reform(1) and not watch.must_reform(2) and not stop.is_set()
        api.join_rendezvous(JoinRequest(a.node_id, a.incarnation, 1, "h", 1))  # a re-forms
        assert api.get_comm_world(a.node_id, 2, HELD).round == 2
        watch.arm(a.node_id, 2)  # the next round's watch starts clean
        time.sleep(0.2)
        assert not watch.must_reform(2)
        job.lifecycle.stop("ended by the test")
        assert stop.wait(5)  # the watch hears the end at once and tells the agent to stop
    finally:
        watch.close()


def test_a_large_job_s_nodes_spread_their_re_joins_and_watches(monkeypatch):
    """What one change makes every node send at once is spread over alive nodes /
    SPREAD_NODES_PER_S seconds, as the master tells (a round's `CommWorld.spread_s`, a
    re-form's `Waiting.spread_s`): the watch of a closed round starts at a random point within
    it, and a survivor joins again at a random point within it."""
    import dlrover.master.membership as membership

    monkeypatch.setattr(membership, "SPREAD_NODES_PER_S", 2 / 0.6)  # 2 nodes: 0.6 s
    job = JobMaster(JobMasterConfig(rendezvous=RendezvousConfig(1, 2)), MemoryStateStore())
    api = LocalMasterApi(job)
    a, b = (api.register_node(Registration("h", 1)) for _ in range(2))
    for n in (a, b):
        api.join_rendezvous(JoinRequest(n.node_id, n.incarnation, 1, "h", 1))
    job.members.close_round_if_due()
    world = api.get_comm_world(a.node_id, 1, HELD)
    assert world.complete and world.spread_s == pytest.approx(0.6)
    asked: list[float] = []

    class Counting:
        def num_nodes_waiting(self, node_id: str, round: int, wait_s: float) -> Any:
            asked.append(time.monotonic())
            return api.num_nodes_waiting(node_id, round, min(wait_s, 0.2))

    stop = threading.Event()
    watch = MembershipWatch(Counting(), stop, wait_s=HELD)  # type: ignore[arg-type]
    try:
        armed = time.monotonic()
        watch.arm(a.node_id, 1, after_s=0.5)
        deadline = time.monotonic() + 5
        while not asked and time.monotonic() < deadline:
            time.sleep(0.01)
        assert asked and asked[0] - armed >= 0.5  # not before its point in the spread
        assert watch.take_rejoin_at() is None  # no re-form told
        job.members.lose(b.node_id, "gone")  # the world must re-form
        while not watch.must_reform(1) and time.monotonic() < deadline:
            time.sleep(0.01)
        told = time.monotonic()
        w = api.num_nodes_waiting(a.node_id, 1, 0.0)
        assert w.waiting > 0 and w.spread_s == pytest.approx(0.3)  # one node alive now
        rejoin_at = watch.take_rejoin_at()
        assert rejoin_at is not None and rejoin_at - told <= 0.3 + 0.05
        assert watch.take_rejoin_at() is None  # taken once, by the next join
    finally:
        watch.close()


def test_agents_started_together_do_not_beat_together():
    """Each agent starts every new interval at a random phase and varies later waits by 10%:
    a thousand agents started in the same second spread their beats over the interval."""
    from dlrover.agent.heartbeat import Heartbeat

    beats = [Heartbeat(None, 2.0, lambda: None) for _ in range(1000)]  # type: ignore[arg-type]
    first = [b.next_wait_s() for b in beats]
    assert all(0.0 <= w <= 2.0 for w in first)
    # Spread over the whole interval: every fifth of it holds some of the first beats.
    assert {int(w / 0.4) for w in first} >= {0, 1, 2, 3, 4}
    assert all(1.8 <= b.next_wait_s() <= 2.2 for b in beats)  # then about one interval
    for b in beats:
        b.stretch(20.0)  # a big job: the master asks for 20 s
    stretched = [b.next_wait_s() for b in beats]
    assert all(0.0 <= w <= 20.0 for w in stretched) and max(stretched) - min(stretched) > 15


def test_calls_waiting_on_a_pool_thread_end_when_the_master_stops():
    """A key-value read of a key nobody sets and a checkpoint wait for a step nobody commits hold
    pool threads, which the interpreter joins at exit: stopping the master ends them at once
    (before, a finished job's `dlrover submit` stayed 30 s for a reader of the TF cluster key)."""
    s = MasterServer(
        JobMaster(JobMasterConfig(job_name="j"), MemoryStateStore()), TOKEN, "127.0.0.1"
    ).start()
    c = MasterClient(f"127.0.0.1:{s.port}", TOKEN, rpc_timeout_s=HELD + 5)
    ended: list[str] = []  # how each held call ended, on the caller's side

    def call(fn: Callable[[], object]) -> None:
        try:
            ended.append(f"answered {fn()!r}")
        except MasterUnreachableError:  # the master went away under the call: what callers see
            ended.append("unreachable")

    held = [
        threading.Thread(target=call, args=(lambda: c.kv_get("never-set", wait_s=HELD),)),
        threading.Thread(target=call, args=(lambda: c.wait_checkpoint_committed(7, HELD),)),
    ]
    try:
        for t in held:
            t.start()
        assert s.job.kv.wait_for_readers("never-set", 1, timeout=10)

        def pool_threads() -> list[threading.Thread]:
            return [t for t in threading.enumerate() if t.name.startswith("dlrover-master-wait")]

        deadline = time.monotonic() + 10
        while len(pool_threads()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # the checkpoint wait reaching its thread; bounded above
        assert len(pool_threads()) >= 2
        started = time.monotonic()
        s.stop(0.1)
        for t in [*pool_threads(), *held]:
            t.join(timeout=HELD)
        assert time.monotonic() - started < 5, "a wait held a pool thread past the master's stop"
        assert len(ended) == 2, ended  # both callers were answered, neither left hanging
    finally:
        s.stop(0.1)
        c.close()
