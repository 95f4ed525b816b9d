"""The master's sharding calls answered in one turn of its loop share one write of the state,
and none is answered before that write: the real servicer, sharding part and SQLite store,
without the gRPC transport (the end-to-end sharding tests run the same path through it)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Collection
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest

from dlrover.api.wire import RPCS
from dlrover.master import server as server_module
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.server import MasterServicer
from dlrover.master.sharding_service import ShardingService
from dlrover.master.state_store import SqliteStateStore, StateStoreError
from dlrover.proto import master_pb2 as pb
from dlrover.sharding.errors import ShardingError
from dlrover.sharding.types import DatasetSpec

CALLS = 24


class CountingStore(SqliteStateStore):
    """SQLite that counts the sharding part's writes and fails the next one when told to (a
    fake for this test)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.writes = 0
        self.fail_next = False

    def put_many(
        self, namespace: str, values: dict[str, bytes], delete: Collection[str] = ()
    ) -> None:
        if namespace == "sharding":
            if self.fail_next:
                self.fail_next = False
                raise StateStoreError("the disk is full (injected)")
            self.writes += 1
        super().put_many(namespace, values, delete)


def saved_leases(path: Path) -> dict[str, int]:
    """The leases a restarted master has: worker -> shards."""
    restarted = ShardingService(SqliteStateStore(str(path)), clock=lambda: 0.0)
    state = restarted.manager.to_state()
    held: dict[str, int] = {}
    for dataset in state["datasets"]:
        for _, _, worker, _, _ in dataset["leases"]:
            held[worker] = held.get(worker, 0) + 1
    return held


def run_calls(store: CountingStore, body: Any) -> Any:
    """Run ``body(servicer)`` on a loop of its own, as the master's server runs its calls."""
    job = JobMaster(JobMasterConfig(job_name="group"), store)
    job.sharding.register_dataset(DatasetSpec(name="d", size=10_000, shard_size=10))

    async def main() -> Any:
        with futures.ThreadPoolExecutor(2) as pool:
            servicer = MasterServicer(job, asyncio.get_running_loop(), pool)
            try:
                return await body(servicer)
            finally:
                servicer.close()

    return asyncio.run(main())


def fetch(servicer: MasterServicer, worker: str, dataset: str = "d") -> Any:
    request = pb.FetchShardsRequest(dataset=dataset, worker_id=worker, max_count=1)
    call = RPCS["fetch_shards"]
    return servicer._run(call, servicer._implementations[call.interface], request)


def test_calls_of_one_turn_share_one_write_and_each_is_answered_saved(tmp_path: Path) -> None:
    store = CountingStore(str(tmp_path / "state.db"))
    saved_when_answered: dict[str, int] = {}

    async def leased(servicer: MasterServicer, worker: str) -> Any:
        answer = await fetch(servicer, worker)
        # Looked at as the answer comes, before anything else runs on the loop: a restarted
        # master would have this worker's lease.
        saved_when_answered[worker] = saved_leases(tmp_path / "state.db").get(worker, 0)
        return answer

    async def body(servicer: MasterServicer) -> list[Any]:
        before = store.writes
        answers = await asyncio.gather(*(leased(servicer, f"w{i}") for i in range(CALLS)))
        assert store.writes - before == 1
        return answers

    answers = run_calls(store, body)
    assert [len(a.shards) for a in answers] == [1] * CALLS
    assert len({a.shards[0].id for a in answers}) == CALLS
    assert saved_when_answered == {f"w{i}": 1 for i in range(CALLS)}


def test_a_refused_write_fails_every_call_of_its_turn_and_goes_with_the_next(
    tmp_path: Path,
) -> None:
    store = CountingStore(str(tmp_path / "state.db"))

    async def body(servicer: MasterServicer) -> tuple[list[Any], Any]:
        store.fail_next = True
        failed = await asyncio.gather(
            *(fetch(servicer, f"w{i}") for i in range(4)), return_exceptions=True
        )
        assert saved_leases(tmp_path / "state.db") == {}  # nothing answered, nothing saved
        return failed, await fetch(servicer, "late")

    failed, late = run_calls(store, body)
    assert all(isinstance(f, StateStoreError) for f in failed), failed
    assert len(late.shards) == 1
    # The refused write's leases went with the next one (they expire as any unreported lease).
    assert saved_leases(tmp_path / "state.db") == {"w0": 1, "w1": 1, "w2": 1, "w3": 1, "late": 1}


def test_a_refused_call_and_a_read_do_not_wait_for_the_write(tmp_path: Path) -> None:
    store = CountingStore(str(tmp_path / "state.db"))

    async def body(servicer: MasterServicer) -> None:
        before = store.writes
        with pytest.raises(ShardingError):
            await fetch(servicer, "w", dataset="no-such-dataset")
        call = RPCS["dataset_progress"]
        progress = await servicer._run(
            call,
            servicer._implementations[call.interface],
            pb.DatasetProgressRequest(dataset="d"),
        )
        assert progress.dataset == "d"
        assert store.writes == before  # neither changed the state: no write

    run_calls(store, body)


def test_a_cancelled_caller_leaves_the_others_their_answers(tmp_path: Path) -> None:
    store = CountingStore(str(tmp_path / "state.db"))

    async def body(servicer: MasterServicer) -> list[Any]:
        tasks = [asyncio.ensure_future(fetch(servicer, f"w{i}")) for i in range(3)]
        await asyncio.sleep(0)  # each ran its call and waits for the write
        tasks[0].cancel()
        return await asyncio.gather(*tasks[1:])

    answers = run_calls(store, body)
    assert [len(a.shards) for a in answers] == [1, 1]
    assert saved_leases(tmp_path / "state.db") == {"w0": 1, "w1": 1, "w2": 1}


def test_calls_on_other_threads_save_at_once_with_what_was_deferred(tmp_path: Path) -> None:
    store = CountingStore(str(tmp_path / "state.db"))
    service = ShardingService(store, clock=lambda: 0.0)
    service.register_dataset(DatasetSpec(name="d", size=1_000, shard_size=10))
    with service.saves_deferred() as deferred:
        service.fetch_shards("d", "deferred", 1)
    assert deferred.changed and saved_leases(tmp_path / "state.db") == {}
    other = threading.Thread(target=service.fetch_shards, args=("d", "other", 1))
    other.start()
    other.join(10)
    assert saved_leases(tmp_path / "state.db") == {"deferred": 1, "other": 1}
    writes = store.writes
    service.flush()  # already saved by the other thread's call
    assert store.writes == writes


def test_while_calls_come_together_a_write_waits_for_the_window_then_alone_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A long window, so that a busy machine cannot close it before the second call comes.
    monkeypatch.setattr(server_module, "GROUP_WINDOW_S", 0.5)
    store = CountingStore(str(tmp_path / "state.db"))

    async def later(servicer: MasterServicer, worker: str) -> Any:
        await asyncio.sleep(0.05)
        return await fetch(servicer, worker)

    async def body(servicer: MasterServicer) -> tuple[int, int, int, float]:
        loop = asyncio.get_running_loop()
        start = store.writes
        await asyncio.gather(*(fetch(servicer, f"w{i}") for i in range(3)))  # one turn: one write
        together = store.writes
        # They came together: the next write waits for the window, and a call 50 ms later
        # shares it.
        await asyncio.gather(fetch(servicer, "a"), later(servicer, "b"))
        windowed = store.writes
        await fetch(servicer, "alone")  # comes alone: its write serves it only
        began = loop.time()
        await fetch(servicer, "at-once")  # the last write served one call: written at once
        return together - start, windowed - together, store.writes - windowed, loop.time() - began

    together, windowed, alone, took = run_calls(store, body)
    assert (together, windowed, alone) == (1, 1, 2)
    assert took < 0.25
    assert saved_leases(tmp_path / "state.db") == {
        w: 1 for w in ["w0", "w1", "w2", "a", "b", "alone", "at-once"]
    }


def test_a_read_while_a_write_is_pending_is_answered_after_it(tmp_path: Path) -> None:
    store = CountingStore(str(tmp_path / "state.db"))
    saved_when_read: list[dict[str, int]] = []

    async def progress(servicer: MasterServicer) -> Any:
        call = RPCS["dataset_progress"]
        request = pb.DatasetProgressRequest(dataset="d")
        answer = await servicer._run(call, servicer._implementations[call.interface], request)
        saved_when_read.append(saved_leases(tmp_path / "state.db"))
        return answer

    async def body(servicer: MasterServicer) -> Any:
        # The lease is taken, then the progress read, in one turn: the read shows the lease.
        _, answer = await asyncio.gather(fetch(servicer, "w"), progress(servicer))
        return answer

    answer = run_calls(store, body)
    assert answer.leased == 1
    assert saved_when_read == [{"w": 1}]


def test_a_master_that_stepped_down_writes_nothing_more(tmp_path: Path) -> None:
    store = CountingStore(str(tmp_path / "state.db"))

    async def body(servicer: MasterServicer) -> list[Any]:
        before = store.writes
        calls = [asyncio.ensure_future(fetch(servicer, f"w{i}")) for i in range(3)]
        servicer.stop_writes()  # as _step_down does, before the pending write runs
        answers = await asyncio.gather(*calls, return_exceptions=True)
        assert store.writes == before
        return answers

    answers = run_calls(store, body)
    assert all(isinstance(a, StateStoreError) and "stepped down" in str(a) for a in answers)
    assert saved_leases(tmp_path / "state.db") == {}
