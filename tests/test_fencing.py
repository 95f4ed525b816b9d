"""Leadership of a job's state: the newest master leads; an older one stops serving at once."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from dlrover.master.fencing import Fence
from dlrover.master.state_store import MemoryStateStore, SqliteStateStore
from tests.conftest import MasterProcess


def test_each_claim_takes_the_next_epoch_and_the_older_leader_learns_it():
    store = MemoryStateStore()
    first = Fence.claim(store)
    assert first.leader.epoch == 1 and first.leader.pid == os.getpid()
    assert first.superseded() is None
    second = Fence.claim(store)
    assert second.leader.epoch == 2
    assert first.superseded() == second.leader and second.superseded() is None


def test_concurrent_claims_never_share_an_epoch(tmp_path: Path):
    path = str(tmp_path / "state.db")
    SqliteStateStore(path).close()
    epochs: list[int] = []
    lock = threading.Lock()

    def claim() -> None:
        store = SqliteStateStore(path)  # one connection per master, as separate processes have
        fence = Fence.claim(store)
        with lock:
            epochs.append(fence.leader.epoch)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(epochs) == list(range(1, 9))


def test_a_master_whose_state_another_master_took_stops_serving(tmp_path: Path):
    """A second dlrover-master started on the same state (a takeover, say on another machine
    of a shared Redis state) leads; the first stops within a tick, exits 3 and says why."""
    state = str(tmp_path / "state.db")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = MasterProcess(tmp_path / "a", "--state-db", state, "--token", "tok")
    second = None
    try:
        second = MasterProcess(tmp_path / "b", "--state-db", state, "--token", "tok")
        assert first.wait(30) == 3
        log = (tmp_path / "a" / "master.log").read_text()
        assert f"another master (pid {second.proc.pid} on" in log and "took over" in log
        assert second.proc.poll() is None  # the new leader serves on
    finally:
        first.close()
        if second is not None:
            second.close()
