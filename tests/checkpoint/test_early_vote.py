"""The node's load-step vote is cast by its agent as the round forms: the restarted ranks' load
asks the master nothing, and gets the step every node holds (two nodes' savers in this process,
real sockets and shared memory, a sharded format with two ranks per node)."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from dlrover.checkpoint.config import ENV_CHECKPOINT_SOCKET
from dlrover.checkpoint.coordinator import LocalCommitCoordinator
from dlrover.checkpoint.engine import CheckpointEngine, WorkerPlacement
from dlrover.checkpoint.saver import CheckpointSaver
from tests.checkpoint.harness import assert_same

NODES, LOCAL = 2, 2


class Votes(LocalCommitCoordinator):
    """The master's side of the vote, noting which thread of which node asked in which round."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, int, str]] = []
        self.decided = threading.Event()

    def agree_load_step(
        self,
        node_rank: int,
        total_nodes: int,
        local_step: int | None,
        round_id: int,
        timeout: float,
    ) -> int | None:
        self.calls.append((round_id, node_rank, threading.current_thread().name))
        step = super().agree_load_step(node_rank, total_nodes, local_step, round_id, timeout)
        if sum(1 for r, _, _ in self.calls if r == round_id) >= total_nodes:
            self.decided.set()
        return step


def _state(rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(rank)
    return {"w": torch.randn(500, generator=g), "step": rank}


def _ranks(
    savers: list[CheckpointSaver], ckpt: str, round_id: int, monkeypatch: pytest.MonkeyPatch
) -> list[CheckpointEngine]:
    engines = []
    for node, saver in enumerate(savers):
        monkeypatch.setenv(ENV_CHECKPOINT_SOCKET, saver.socket_path)
        for local in range(LOCAL):
            place = WorkerPlacement(
                node * LOCAL + local, local, NODES * LOCAL, LOCAL, node, round_id
            )
            engines.append(CheckpointEngine(ckpt, "dcp", placement=place))
    return engines


def _votes(engines: list[CheckpointEngine]) -> list[int | None]:
    with ThreadPoolExecutor(len(engines)) as pool:
        futures = [pool.submit(e.memory_step, None) for e in engines]
        return [f.result(timeout=60) for f in futures]


def test_the_agent_votes_as_the_round_forms_and_the_ranks_load_without_asking_the_master(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    votes = Votes()
    tag = f"{os.getpid()}-{time.monotonic_ns()}"
    savers = [
        CheckpointSaver(
            str(tmp_path / f"n{n}.sock"), shm_prefix=f"dlrtest-ev{n}-{tag}", coordinator=votes
        )
        for n in range(NODES)
    ]
    for saver in savers:
        saver.start()
    ckpt = str(tmp_path / "ckpt")
    try:
        # Round 1: nothing in memory and no vote seen yet: the agents cast none.
        for node, saver in enumerate(savers):
            saver.prepare_round(1, node, NODES, LOCAL, world_size=NODES * LOCAL, rank_offset=0)
        engines = _ranks(savers, ckpt, 1, monkeypatch)
        assert _votes(engines) == [None] * 4
        assert all(name != "ckpt-early-vote" for _, _, name in votes.calls)
        parts = [_state(rank) for rank in range(NODES * LOCAL)]
        for engine, part in zip(engines, parts, strict=True):
            assert engine.save(3, part, persist=False)
        for engine in engines:
            engine.close()  # the workers are gone: a rank failed, every node restarts its own

        # Round 2 forms: each agent votes for its ranks before they start.
        for node, saver in enumerate(savers):
            saver.prepare_round(
                2, node, NODES, LOCAL, world_size=NODES * LOCAL, rank_offset=node * LOCAL
            )
        assert votes.decided.wait(30), votes.calls
        early = sorted((node, name) for r, node, name in votes.calls if r == 2)
        assert early == [(0, "ckpt-early-vote"), (1, "ckpt-early-vote")]

        engines = _ranks(savers, ckpt, 2, monkeypatch)
        assert _votes(engines) == [3] * 4
        assert len([c for c in votes.calls if c[0] == 2]) == 2  # the ranks asked the master nothing
        for engine, part in zip(engines, parts, strict=True):
            step, state, _ = engine.load_from_memory(None, 3)
            assert step == 3
            assert_same(state, part)
        for engine in engines:
            engine.close()
    finally:
        for saver in savers:
            saver.close(unlink=True)
