"""Flash-checkpoint commit and load-step agreement across nodes: one oracle, run against both
uses of the one vote implementation (in process, and through a real master over gRPC)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from dlrover.checkpoint.coordinator import CommitCoordinator, CommitVotes, LocalCommitCoordinator
from dlrover.client.checkpoint import MasterCommitCoordinator
from dlrover.client.master_client import MasterClient
from dlrover.master.job import JobMaster, JobMasterConfig
from dlrover.master.server import MasterServer
from dlrover.master.state_store import MemoryStateStore


@pytest.fixture(params=["in-process", "master"])
def coordinator(request) -> Iterator[Callable[[], CommitCoordinator]]:
    """A factory of one node's view of the coordinator."""
    if request.param == "in-process":
        shared = LocalCommitCoordinator()
        yield lambda: shared
        return
    server = MasterServer(JobMaster(JobMasterConfig(), MemoryStateStore()), "t", "127.0.0.1", 0)
    server.start()
    yield lambda: MasterCommitCoordinator(MasterClient(f"127.0.0.1:{server.port}", "t"))
    server.stop(0.1)


def test_exactly_one_committer_and_waiters_see_the_commit(coordinator):
    nodes = [coordinator() for _ in range(3)]
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda i: nodes[i].report_persisted(7, i, 3), range(3)))
    assert answers.count(True) == 1
    committer = answers.index(True)
    assert nodes[committer].report_persisted(7, committer, 3)  # a retry keeps its answer
    assert not nodes[(committer + 1) % 3].report_persisted(7, (committer + 1) % 3, 3)
    waiter = threading.Thread(target=lambda: results.append(nodes[0].wait_committed(7, 10)))
    results: list[bool] = []
    waiter.start()
    nodes[committer].mark_committed(7)
    waiter.join(10)
    assert results == [True]
    assert not nodes[1].wait_committed(8, 0.2)


def test_every_node_gets_the_same_load_step(coordinator):
    nodes = [coordinator() for _ in range(3)]
    with ThreadPoolExecutor(3) as pool:
        same = list(pool.map(lambda i: nodes[i].agree_load_step(i, 3, 12, 1, 10), range(3)))
        differ = list(
            pool.map(lambda i: nodes[i].agree_load_step(i, 3, 12 - (i == 2), 2, 10), range(3))
        )
    assert same == [12, 12, 12]
    assert differ == [None, None, None]  # nodes disagree: everybody loads from storage
    assert nodes[0].agree_load_step(0, 2, 5, 3, timeout=0.3) is None  # the other never voted


def test_the_master_remembers_the_committed_step_across_its_restart():
    store = MemoryStateStore()
    JobMaster(JobMasterConfig(), store).checkpoint.mark_committed(9)
    again = JobMaster(JobMasterConfig(), store).checkpoint
    assert again.wait_committed(9, 0) and not again.wait_committed(10, 0)


def test_a_late_report_of_a_committed_step_never_makes_a_second_committer():
    votes = CommitVotes()
    assert [votes.report_persisted(5, rank, 2) for rank in (0, 1)] == [False, True]
    votes.mark_committed(5)
    assert votes.report_persisted(5, 1, 2)  # the committer's retry keeps its answer
    assert not votes.report_persisted(5, 0, 2)
    votes.mark_committed(5 + 2000)  # long after: the step's committer is forgotten
    assert [votes.report_persisted(5, rank, 2) for rank in (0, 1)] == [False, False]
