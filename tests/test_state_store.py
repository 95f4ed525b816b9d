"""StateStore contract, for the in-memory and the SQLite store alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrover.master.state_store import (
    MemoryStateStore,
    SqliteStateStore,
    StateStoreError,
    open_state_store,
)


@pytest.fixture(params=["memory", "sqlite"])
def store(request, tmp_path: Path):
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
