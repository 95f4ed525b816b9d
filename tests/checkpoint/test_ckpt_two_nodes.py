"""A sharded (DCP) step written by two simulated nodes, each with its own agent-side saver."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from dlrover.checkpoint.coordinator import LocalCommitCoordinator
from tests.checkpoint.harness import assert_same, free_port, run_workers, running_saver, worker_env


def _node_envs(sockets: list[str], restart: int = 0) -> list[dict[str, str]]:
    """Rank r runs alone on node r (its local rank 0), talking to that node's saver."""
    port = free_port()
    envs = []
    for rank, sock in enumerate(sockets):
        env = worker_env(sock, rank=rank, world=len(sockets), port=port, restart=restart)
        env.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank))
        envs.append(env)
    return envs


@pytest.mark.e2e
def test_two_nodes_merge_one_dcp_checkpoint_loadable_by_plain_dcp(tmp_path: Path) -> None:
    ckpt, oracle = str(tmp_path / "ckpt"), str(tmp_path / "oracle.pt")
    master = LocalCommitCoordinator()  # what the job master provides between nodes
    with (
        running_saver(tmp_path, coordinator=master) as node0,
        running_saver(tmp_path, coordinator=master) as node1,
    ):
        sockets = [node0.socket_path, node1.socket_path]
        run_workers(["fsdp_save", ckpt, "4", oracle], _node_envs(sockets), timeout=120)
        assert node0.held_steps() == {0: 4} and node1.held_steps() == {0: 4}
        step = tmp_path / "ckpt" / "step_4"
        # Each node wrote its own rank's file and its own part; one of them committed.
        assert sorted(p.name for p in step.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        assert sorted(p.name for p in step.glob("node_*.json")) == ["node_0.json", "node_1.json"]
        manifest = json.loads((step / "manifest.json").read_text())
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(manifest["files"])
        assert (tmp_path / "ckpt" / "latest").read_text() == "4"
        # Both nodes vote through the shared coordinator and load their shards from memory.
        run_workers(
            ["fsdp_load", ckpt, "4", oracle, "memory"], _node_envs(sockets, restart=1), timeout=120
        )

    expected = torch.load(oracle, weights_only=True)
    target: dict[str, dict[str, Any]] = {
        "model": {k: torch.empty_like(v) for k, v in expected["model"].items()},
        "extra": {"step": None},
    }
    dcp.load(target, checkpoint_id=str(tmp_path / "ckpt" / "step_4"))  # no process group
    assert_same(expected["model"], target["model"])
    assert target["extra"]["step"] == 4


def test_a_node_that_only_keeps_a_memory_copy_learns_the_commit_from_the_coordinator(
    tmp_path: Path,
) -> None:
    """DDP across nodes: node 0 persists storage's one copy, node 1 keeps memory only. Its
    workers' wait for the DISK step ends with the job's commit, not at the timeout (it used to
    wait its full timeout at every DISK save: nothing is ever persisted on node 1)."""
    import threading
    import time

    from dlrover.checkpoint.saver_messages import WaitPersistedRequest

    coordinator = LocalCommitCoordinator()
    with running_saver(tmp_path, coordinator=coordinator) as node1:
        replies = []
        start = time.monotonic()
        waiter = threading.Thread(
            target=lambda: replies.append(
                node1._dispatch(WaitPersistedRequest(str(tmp_path / "ckpt"), 5, 30.0))
            )
        )
        waiter.start()
        assert not replies  # not committed yet: it waits
        coordinator.mark_committed(5)  # node 0 committed step 5
        waiter.join(30)
        (reply,) = replies
        assert reply.persisted and reply.committed == 5 and reply.failure is None
        assert time.monotonic() - start < 10


def test_without_a_master_a_memory_only_node_learns_the_commit_from_storage(
    tmp_path: Path,
) -> None:
    """DDP across nodes under plain torchrun: each worker's in-process saver has a coordinator
    of its own, so node 1 never hears of node 0's commit. Storage's "latest" marker (written
    last, atomically) says it: node 1's wait for step 5 ends once the marker names it, not at
    its timeout (found by benchmarks/fault_campaign.py: every torchrun job of 2 nodes waited
    its final wait_latest_checkpoint out)."""
    import threading

    from dlrover.checkpoint.saver_messages import WaitPersistedRequest

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    with running_saver(tmp_path, coordinator=LocalCommitCoordinator()) as node1:
        replies = []
        waiter = threading.Thread(
            target=lambda: replies.append(node1._dispatch(WaitPersistedRequest(str(ckpt), 5, 60.0)))
        )
        waiter.start()
        waiter.join(0.5)
        assert not replies  # nothing on storage yet: it waits
        (ckpt / "latest").write_text("4")
        waiter.join(0.5)
        assert not replies  # an older step is not the one waited for
        (ckpt / "latest").write_text("5")  # node 0's saver committed step 5
        waiter.join(30)
        (reply,) = replies
        assert reply.persisted and reply.committed == 5 and reply.failure is None
