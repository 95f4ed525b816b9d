"""Nodes ride out a master restart (in process: a JobMaster rebuilt on the same state store
stands in for the restarted master; calls meanwhile fail as they do over the wire)."""

from __future__ import annotations

import inspect
import threading
import time
from pathlib import Path
from typing import Any

from dlrover.agent.config import AgentConfig
from dlrover.agent.rendezvous_client import RendezvousClient
from dlrover.api.errors import MasterUnreachableError
from dlrover.api.master import NodeOutcome
from dlrover.master.job import JobMaster, JobMasterConfig, JobState
from dlrover.master.local_api import LocalMasterApi
from dlrover.master.state_store import SqliteStateStore


class RestartingMaster:
    """A MasterApi that is down between `die()` and `restart()`, then a new JobMaster on the
    same state (what a SIGKILLed dlrover-master started again on its --state-db is)."""

    def __init__(self, path: Path) -> None:
        self.store = SqliteStateStore(str(path))
        self.api: LocalMasterApi | None = LocalMasterApi(JobMaster(JobMasterConfig(), self.store))
        self.refused = threading.Event()
        """Set once a call found the master down."""
        self.answered: dict[str, threading.Event] = {}
        """Per call name: set once the master answered such a call."""

    def die(self) -> None:
        self.api = None

    def restart(self) -> JobMaster:
        job = JobMaster(JobMasterConfig(), self.store)
        self.api = LocalMasterApi(job)
        return job

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            api = self.api
            if api is None:
                self.refused.set()
                raise MasterUnreachableError("the master at test:0 did not answer (down)")
            bound = inspect.signature(getattr(LocalMasterApi, name)).bind(api, *args, **kwargs)
            wait_s = bound.arguments.pop("wait_s", 0.0)
            del bound.arguments["self"]
            deadline = time.monotonic() + wait_s
            while True:  # a long poll, in slices: a master that dies drops the held call
                left = max(0.0, deadline - time.monotonic())
                held = {"wait_s": min(left, 0.05)} if wait_s else {}
                result = getattr(api, name)(*bound.args, **bound.kwargs, **held)
                if api is not self.api:
                    self.refused.set()
                    raise MasterUnreachableError("the master at test:0 dropped the call (down)")
                if not wait_s or left <= 0 or not _incomplete(name, result):
                    break
            self.answered.setdefault(name, threading.Event()).set()
            return result

        return call

    def wait_answered(self, name: str, timeout: float = 10) -> bool:
        return self.answered.setdefault(name, threading.Event()).wait(timeout)


def _incomplete(name: str, result: Any) -> bool:
    """Whether a long poll's answer says "nothing yet" (so the slice loop goes on)."""
    if name == "get_comm_world":
        return not (result.complete or result.rejoin)
    if name == "report_node_status":
        return not result
    return False


def _client(master: RestartingMaster) -> RendezvousClient:
    config = AgentConfig(
        entrypoint=["x"], nproc_per_node=2, min_nodes=2, max_nodes=2, join_timeout_s=5
    )
    client = RendezvousClient(master, config, threading.Event())  # type: ignore[arg-type]
    client.register("", "127.0.0.1", "job")
    return client


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    return thread, result


def test_a_join_lost_with_the_master_is_repeated_and_the_round_forms(tmp_path: Path):
    master = RestartingMaster(tmp_path / "state.db")
    a, b = _client(master), _client(master)
    first, seen_by_a = _in_thread(lambda: a.join("h0", 1000))
    assert master.wait_answered("join_rendezvous")
    # a waits for b when the master dies: its join lives only in the dead master's memory
    master.die()
    assert master.refused.wait(10)  # a's poll met the dead master
    master.restart()
    second, seen_by_b = _in_thread(lambda: b.join("h1", 1001))
    first.join(20)
    second.join(20)
    assert len(seen_by_a) == len(seen_by_b) == 1
    world_a, world_b = seen_by_a[0], seen_by_b[0]
    assert world_a.complete and world_b.complete and world_a.round == world_b.round == 1
    assert sorted([world_a.node_rank, world_b.node_rank]) == [0, 1] and world_a.world_size == 4


def test_a_success_report_lost_with_the_master_reaches_the_restarted_one(tmp_path: Path):
    master = RestartingMaster(tmp_path / "state.db")
    a, b = _client(master), _client(master)
    joins = [_in_thread(lambda c=c, port=port: c.join("h", port)) for c, port in ((a, 1), (b, 2))]
    for thread, _ in joins:
        thread.join(20)
    assert not a.report(NodeOutcome.SUCCEEDED, 0, "")  # a's success is saved; b still runs
    master.die()
    barrier_a, result_a = _in_thread(a.exit_barrier)  # a waits at the barrier through the outage
    assert master.refused.wait(10)
    job = master.restart()
    barrier_b, result_b = _in_thread(b.exit_barrier)
    barrier_a.join(20)
    barrier_b.join(20)
    assert [r.exit_code for r in result_a + result_b] == [0, 0]
    assert job.lifecycle.state is JobState.SUCCEEDED
