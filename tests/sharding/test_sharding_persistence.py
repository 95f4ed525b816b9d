"""What the master writes of its shards: each call its change (the leases it granted, released or
moved on, one key each), never the whole lease table; a restarted master has every lease back,
from this release's state and from the one before's."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import pytest

from dlrover.master.sharding_service import ShardingService
from dlrover.master.state_store import MemoryStateStore, SqliteStateStore, StateStoreError
from dlrover.sharding.types import DatasetSpec, DeliveryMode, ShardId


class CountingStore(MemoryStateStore):
    """A memory store that counts the bytes each write carries (a fake for this unit test)."""

    def __init__(self) -> None:
        super().__init__()
        self.written = 0

    def put(self, namespace: str, key: str, value: bytes) -> None:
        self.written += len(value)
        super().put(namespace, key, value)

    def put_many(
        self, namespace: str, values: dict[str, bytes], delete: Collection[str] = ()
    ) -> None:
        self.written += sum(len(v) for v in values.values()) + sum(len(k) for k in delete)
        super().put_many(namespace, values, delete)


class FlakyStore(SqliteStateStore):
    """A SQLite store whose next `put_many` fails once when told to (a fake for this test)."""

    fail_next = False

    def put_many(
        self, namespace: str, values: dict[str, bytes], delete: Collection[str] = ()
    ) -> None:
        if self.fail_next:
            self.fail_next = False
            raise StateStoreError("the disk is full (injected)")
        super().put_many(namespace, values, delete)


def leases_of(state: dict) -> list[list]:
    return sorted(lease for d in state["datasets"] for lease in d["leases"])


def spec(name: str = "d", mode: DeliveryMode = DeliveryMode.AT_LEAST_ONCE) -> DatasetSpec:
    return DatasetSpec(name=name, size=100_000, shard_size=10, mode=mode)


def test_a_lease_call_writes_its_change_not_the_leases_in_flight() -> None:
    store = CountingStore()
    service = ShardingService(store, clock=lambda: 0.0)
    service.register_dataset(spec())

    def one_lease_and_its_report() -> int:
        before = store.written
        (shard,) = service.fetch_shards("d", "w-probe", 1).shards
        service.report_done("d", "w-probe", [shard.id])
        return store.written - before

    service.fetch_shards("d", "w0", 10)
    few = one_lease_and_its_report()
    for i in range(40):  # 2,000 more leases held by 40 workers
        service.fetch_shards("d", f"w{i + 1}", 50)
    many = one_lease_and_its_report()
    assert len(service.manager.to_state()["datasets"][0]["leases"]) == 2010
    # The same bytes, give or take the digits of a grown cursor (before: the whole table, 2,010
    # leases of about 20 bytes each, twice).
    assert many <= few + 16, (few, many)


def test_a_restarted_master_has_every_lease_as_the_calls_left_it(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    store = SqliteStateStore(path)
    service = ShardingService(store, clock=lambda: 0.0)
    service.register_dataset(spec("a/b", DeliveryMode.EXACTLY_ONCE))  # a "/" in the name
    service.register_dataset(spec("c"))
    leased = {w: service.fetch_shards("a/b", w, 8).shards for w in ("n0/0", "n0/1", "n1/0")}
    service.fetch_shards("c", "n1/0", 3)
    service.report_done("a/b", "n0/0", [s.id for s in leased["n0/0"][:5]])
    service.report_progress("a/b", "n0/1", leased["n0/1"][0].id, 7)  # moved on: its offset
    assert service.recover_node("n1") == 11  # released and requeued, in both datasets
    again = leased["n0/0"][5]
    service.report_progress("a/b", "n0/0", again.id, 3)
    before = service.manager.to_state()
    store.close()

    restarted = ShardingService(SqliteStateStore(path), clock=lambda: 0.0)
    after = restarted.manager.to_state()
    for state in (before, after):  # the order leases were granted in is not kept
        for dataset in state["datasets"]:
            dataset["leases"].sort()
    assert after == before
    (a,) = [d for d in after["datasets"] if d["spec"]["name"] == "a/b"]
    assert len(a["leases"]) == 3 + 8  # n0/0's 3 left, n0/1's 8
    moved_on = [ShardId(e, i) for e, i, _, offset, _ in a["leases"] if offset]
    assert moved_on == [again.id, leased["n0/1"][0].id]


def test_the_state_of_the_release_before_is_read_and_written_anew(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    old = ShardingService(SqliteStateStore(path), clock=lambda: 0.0)
    old.register_dataset(spec())
    old.fetch_shards("d", "w0", 4)
    state = old.manager.to_state()  # every lease in it, as the release before wrote it
    state["version"] = 1
    store = SqliteStateStore(str(tmp_path / "old.db"))
    store.put_json("sharding", "state", state)

    upgraded = ShardingService(store, clock=lambda: 0.0)
    assert len(upgraded.manager.to_state()["datasets"][0]["leases"]) == 4
    upgraded.fetch_shards("d", "w1", 1)  # the first call writes this release's form
    store.close()
    again = ShardingService(SqliteStateStore(str(tmp_path / "old.db")), clock=lambda: 0.0)
    leases = again.manager.to_state()["datasets"][0]["leases"]
    assert sorted(w for _, _, w, _, _ in leases) == ["w0"] * 4 + ["w1"]


def test_changes_a_failed_write_did_not_save_go_with_the_next(tmp_path: Path) -> None:
    path = str(tmp_path / "state.db")
    store = FlakyStore(path)
    now = [0.0]
    service = ShardingService(store, clock=lambda: now[0])
    service.register_dataset(spec())
    first = service.fetch_shards("d", "w0", 3).shards
    store.fail_next = True
    with pytest.raises(StateStoreError):
        service.fetch_shards("d", "w1", 2)  # leased in memory, not written
    store.fail_next = True
    with pytest.raises(StateStoreError):
        service.report_done("d", "w0", [first[0].id])  # released in memory, not written
    service.fetch_shards("d", "w2", 1)  # this write carries the three changes before it too
    read = ShardingService(SqliteStateStore(path), clock=lambda: 0.0).manager.to_state()
    assert leases_of(read) == leases_of(service.manager.to_state())
    assert sorted(w for _, _, w, _, _ in leases_of(read)) == ["w0", "w0", "w1", "w1", "w2"]
    now[0] = 10_000.0  # every lease expires: the tick requeues them and writes that
    service.tick()
    before = service.manager.to_state()
    store.close()
    again = ShardingService(SqliteStateStore(path), clock=lambda: 0.0).manager.to_state()
    assert leases_of(again) == leases_of(before) == []
    assert again["datasets"][0]["requeued"] == before["datasets"][0]["requeued"]
    assert len(before["datasets"][0]["requeued"]) == 5 and before["datasets"][0]["cursor"] == 6
