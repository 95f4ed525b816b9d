"""StateStore contract, for the in-memory and the SQLite store alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrover.api.master import NodeLimits, Registration
from dlrover.master.state_store import (
    MemoryStateStore,
    SqliteStateStore,
    StateStoreError,
    open_state_store,
)
from tests.conftest import redis_missing

REDIS = pytest.param(
    "redis",
    marks=[pytest.mark.extras, pytest.mark.skipif(bool(redis_missing()), reason=redis_missing())],
)


@pytest.fixture(params=["memory", "sqlite", REDIS])
def store(request, tmp_path: Path):
    if request.param == "redis":
        server = request.getfixturevalue("redis_server")
        s = open_state_store(server.url + "?prefix=test")
    else:
        s = open_state_store("memory" if request.param == "memory" else str(tmp_path / "s.db"))
    yield s
    s.close()


def test_put_get_delete_items(store):
    assert store.get("ns", "k") is None
    store.put("ns", "k", b"v1")
    store.put("other", "k", b"x")
    assert store.get("ns", "k") == b"v1"
    assert store.items("ns") == {"k": b"v1"}
    store.delete("ns", "k")
    assert store.get("ns", "k") is None
    assert store.items("other") == {"k": b"x"}


def test_compare_and_set_fences_a_stale_writer(store):
    assert store.compare_and_set("ns", "leader", None, b"a")
    assert not store.compare_and_set("ns", "leader", None, b"b")
    assert not store.compare_and_set("ns", "leader", b"x", b"b")
    assert store.compare_and_set("ns", "leader", b"a", b"b")
    assert store.get("ns", "leader") == b"b"


def test_json_round_trip(store):
    store.put_json("ns", "j", {"round": 3, "members": ["a"]})
    assert store.get_json("ns", "j") == {"round": 3, "members": ["a"]}


def test_put_many_writes_every_value_at_once(store):
    store.put("ns", "a", b"old")
    store.put_json_many("ns", {"a": {"v": 1}, "b": [2]})
    store.put_many("ns", {})
    assert store.get_json("ns", "a") == {"v": 1} and store.get_json("ns", "b") == [2]
    assert sorted(store.items("ns")) == ["a", "b"]


def test_put_many_also_removes_keys_in_the_same_write(store):
    store.put_many("ns", {"a": b"1", "b": b"2", "c": b"3"})
    store.put_json_many("ns", {"d": 4, "c": 5}, delete=["a", "c", "absent"])
    assert store.items("ns") == {"b": b"2", "c": b"5", "d": b"4"}  # "c" both: written
    store.put_many("ns", {}, delete=["b"])
    assert sorted(store.items("ns")) == ["c", "d"]


def test_a_failed_put_many_writes_none_of_its_values(tmp_path: Path):
    store = SqliteStateStore(str(tmp_path / "s.db"))
    store.put("ns", "a", b"old")
    store.put("ns", "gone", b"kept")
    with pytest.raises(Exception):  # noqa: B017 - sqlite's own error for a value it cannot bind
        store.put_many("ns", {"a": b"new", "b": object()}, delete=["gone"])  # type: ignore[dict-item]
    assert store.get("ns", "a") == b"old" and store.get("ns", "b") is None
    assert store.get("ns", "gone") == b"kept"
    store.put("ns", "c", b"after")  # the connection is usable again
    assert store.get("ns", "c") == b"after"


def test_a_round_s_members_are_persisted_running_with_their_ranks(tmp_path: Path):
    """NodeTable.activate: the members of a closed round, RUNNING with their node ranks, as a
    restarted master reads them back (one write for the round)."""
    from dlrover.master.nodes import NodeState, NodeTable

    path = str(tmp_path / "s.db")
    table = NodeTable(SqliteStateStore(path), lambda: 0.0)
    for i in range(3):
        table.register(f"n{i}", "h", "worker", 1, -1, 100 + i)
    table.activate({"n0": 2, "n1": 0, "n2": 1}, "member of round 1")
    again = NodeTable(SqliteStateStore(path), lambda: 0.0)
    rows = sorted((n.node_id, n.state, n.node_rank, n.pid) for n in again.all())
    assert rows == [
        ("n0", NodeState.RUNNING, 2, 100),
        ("n1", NodeState.RUNNING, 0, 101),
        ("n2", NodeState.RUNNING, 1, 102),
    ]


def test_sqlite_state_survives_reopening(tmp_path: Path):
    path = str(tmp_path / "state.db")
    s = SqliteStateStore(path)
    s.put_json("rendezvous", "world", {"round": 7})
    s.close()
    again = SqliteStateStore(path)
    assert again.get_json("rendezvous", "world") == {"round": 7}
    again.close()


def test_unwritable_database_is_a_clear_error(tmp_path: Path):
    with pytest.raises(StateStoreError, match="--state-db"):
        SqliteStateStore(str(tmp_path / "missing-dir" / "state.db"))


def test_memory_store_is_the_default_for_empty_spec():
    assert isinstance(open_state_store(""), MemoryStateStore)


def test_a_master_refuses_another_jobs_state_and_changes_nothing(tmp_path: Path):
    from dlrover.master.assembly import MasterSettings, build_master
    from dlrover.master.state_store import StateMismatchError

    path = str(tmp_path / "state.db")
    first = build_master(MasterSettings("job-a", "token-a", host="127.0.0.1", state=path))
    first.job.kv.set("k", b"v")
    first.stop(0)
    before = SqliteStateStore(path)
    saved = {ns: before.items(ns) for ns in ("job", "kv")}
    before.close()
    with pytest.raises(StateMismatchError, match="belongs to job 'job-a', not 'job-b'"):
        build_master(MasterSettings("job-b", "token-a", host="127.0.0.1", state=path))
    with pytest.raises(StateMismatchError, match="another token"):
        build_master(MasterSettings("job-a", "token-b", host="127.0.0.1", state=path))
    after = SqliteStateStore(path)
    assert {ns: after.items(ns) for ns in ("job", "kv")} == saved
    after.close()
    again = build_master(MasterSettings("job-a", "token-a", host="127.0.0.1", state=path))
    assert again.job.kv.get("k") == b"v"  # the rightful master resumes it
    again.stop(0)


def test_a_corrupt_state_file_is_named_and_left_alone(tmp_path: Path):
    path = tmp_path / "state.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StateStoreError, match="not a DLRover state database, or it is corrupt"):
        SqliteStateStore(str(path))
    assert path.read_bytes() == b"this is not sqlite" * 100
    store = SqliteStateStore(str(tmp_path / "ok.db"))
    store.put("job", "state", b"{not json")
    with pytest.raises(StateStoreError, match="job/state in .*ok.db is corrupt"):
        store.get_json("job", "state")
    store.close()


def test_the_node_range_survives_a_master_restart_and_a_conflicting_one_is_refused(
    tmp_path: Path,
):
    from dlrover.master.job import JobMaster, JobMasterConfig
    from dlrover.master.rendezvous import RendezvousConfig, RendezvousError

    store = SqliteStateStore(str(tmp_path / "state.db"))
    JobMaster(JobMasterConfig(), store).members.register_node(
        Registration("h", 2, "", "w", -1, 1, limits=NodeLimits(2, 4, 1, 1.0))
    )
    restarted = JobMaster(JobMasterConfig(), store)  # no --nnodes: the saved range holds
    assert restarted.members.rdzv().config == RendezvousConfig(2, 4)
    with pytest.raises(RendezvousError, match="has --nnodes 2:4 .* started with 1:1"):
        JobMaster(JobMasterConfig(rendezvous=RendezvousConfig(1, 1)), store)
    store.close()


@pytest.mark.extras
@pytest.mark.skipif(bool(redis_missing()), reason=redis_missing())
def test_a_master_on_another_machine_takes_over_from_redis(redis_server):
    from dlrover.master.assembly import MasterSettings, build_master
    from dlrover.master.rendezvous import RendezvousConfig
    from dlrover.master.state_store import StateMismatchError

    state = redis_server.url + "?prefix=job-a"
    first = build_master(MasterSettings("job-a", "t", host="127.0.0.1", state=state))
    node = first.job.members.register_node(
        Registration("h", 2, "", "w", -1, 1, limits=NodeLimits(1, 2, 1, 1.0))
    )
    first.job.kv.set("k", b"v")
    first.job.checkpoint.mark_committed(12)
    first.stop(0)  # the first master's machine is gone
    redis_server.restart()  # and Redis itself restarts: its append-only file keeps the state
    other = build_master(MasterSettings("job-a", "t", host="127.0.0.1", state=state))
    assert other.job.members.nodes.get(node.node_id).incarnation == node.incarnation
    assert other.job.kv.get("k") == b"v" and other.job.checkpoint.wait_committed(12, 0)
    assert other.job.members.rdzv().config == RendezvousConfig(1, 2)
    other.stop(0)
    with pytest.raises(StateMismatchError, match="another token"):
        build_master(MasterSettings("job-a", "not-t", host="127.0.0.1", state=state))
    # another prefix is another job's state on the same server
    fresh = build_master(
        MasterSettings("job-b", "u", host="127.0.0.1", state=redis_server.url + "?prefix=job-b")
    )
    assert fresh.job.kv.get("k") is None
    fresh.stop(0)


@pytest.mark.extras
@pytest.mark.skipif(bool(redis_missing()), reason=redis_missing())
def test_an_unreachable_redis_is_a_clear_error():
    from tests.conftest import _free_port

    with pytest.raises(StateStoreError, match="cannot be reached .* redis-server running") as e:
        open_state_store(f"redis://:secret@127.0.0.1:{_free_port()}/0")
    assert "secret" not in str(e.value)  # the password never reaches a log
