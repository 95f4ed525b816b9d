"""DDP flash checkpoints end to end: real saver, real worker processes, real files."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from dlrover.checkpoint.config import ENV_CHECKPOINT_SOCKET
from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType as StorageTypeAlias
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType
from tests.checkpoint.harness import (
    assert_same,
    expected_state,
    run_workers,
    running_saver,
    worker_env,
)


def test_storage_type_is_one_enum() -> None:
    assert StorageType is StorageTypeAlias
    assert {t.name for t in StorageType} == {"MEMORY", "DISK"}


def test_two_ranks_save_then_load_from_memory_then_from_storage(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    with running_saver(tmp_path) as saver:
        envs = [worker_env(saver.socket_path, rank=r, world=2) for r in range(2)]
        run_workers(["ddp_save", ckpt, "1", "disk"], envs)
        assert (tmp_path / "ckpt" / "latest").read_text() == "1"
        assert sorted(p.name for p in (tmp_path / "ckpt" / "step_1").iterdir()) == [
            "manifest.json",
            "node_0.json",
            "rank_0.bin",
            "rank_0.meta.json",
        ]
        assert saver.held_steps() == {0: 1}  # only local rank 0 copies (DDP replicas)
        run_workers(
            ["ddp_load", ckpt, "1", "memory"],
            [worker_env(saver.socket_path, rank=r, world=2, restart=1) for r in range(2)],
        )
    with running_saver(tmp_path) as fresh:  # a new agent: memory is gone, storage remains
        run_workers(["ddp_load", ckpt, "1", "storage"], [worker_env(fresh.socket_path)])


def test_memory_newer_than_storage_wins_and_is_persisted_on_failure(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    with running_saver(tmp_path) as saver:
        env = worker_env(saver.socket_path)
        run_workers(["ddp_save", ckpt, "1", "disk"], [env])
        run_workers(["ddp_save", ckpt, "2", "memory"], [env])
        assert (tmp_path / "ckpt" / "latest").read_text() == "1"
        run_workers(["ddp_load", ckpt, "2", "memory"], [worker_env(saver.socket_path, restart=1)])
        # The workers died: the agent persists what only memory holds, before restarting.
        assert saver.persist_latest_if_newer() == 2
        assert saver.persist_latest_if_newer() is None
        assert (tmp_path / "ckpt" / "latest").read_text() == "2"
    with running_saver(tmp_path) as fresh:
        run_workers(["ddp_load", ckpt, "2", "storage"], [worker_env(fresh.socket_path)])


def test_nothing_saved_loads_empty(tmp_path: Path) -> None:
    with running_saver(tmp_path) as saver:
        run_workers(
            ["ddp_load", str(tmp_path / "ckpt"), "none", "-"], [worker_env(saver.socket_path)]
        )


def test_without_agent_an_in_process_saver_persists(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    run_workers(["ddp_save", ckpt, "4", "disk"], [worker_env(None)])
    run_workers(["ddp_load", ckpt, "4", "storage"], [worker_env(None)])


def test_keep_last_deletes_old_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_CHECKPOINT_SOCKET, raising=False)
    ckpt = DdpCheckpointer(str(tmp_path / "ckpt"), keep_last=2)
    try:
        for step in range(1, 5):
            assert ckpt.save_checkpoint(step, expected_state(step))
            assert ckpt.wait_latest_checkpoint(30)
        # Older steps go right after the commit is announced (not part of the save's time).
        deadline = time.monotonic() + 10
        while len(list((tmp_path / "ckpt").glob("step_*"))) > 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # the persist thread deletes them; nothing to wait on from here
        assert sorted(p.name for p in (tmp_path / "ckpt").glob("step_*")) == ["step_3", "step_4"]
        manifest = json.loads((tmp_path / "ckpt" / "step_4" / "manifest.json").read_text())
        assert manifest["files"]["rank_0.bin"]["size"] > 0
        # An explicit resume path (a step directory) loads that step.
        state = ckpt.load_checkpoint(resume_path=str(tmp_path / "ckpt" / "step_3"))
        assert_same(expected_state(3), state)
        assert torch.equal(state["model"]["w"], expected_state(3)["model"]["w"])
    finally:
        ckpt.close()


def test_memory_save_never_overwrites_a_step_waiting_to_be_persisted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_CHECKPOINT_SOCKET, raising=False)
    ckpt = DdpCheckpointer(str(tmp_path / "ckpt"))
    try:
        for step in range(1, 4):
            assert ckpt.save_checkpoint(step * 10, expected_state(step * 10))
            # Right away, while step*10 is pending/persisting: taken, into the other buffer;
            # the persist still writes step*10, never a mix.
            assert ckpt.save_checkpoint(
                step * 10 + 1, expected_state(step * 10 + 1), storage_type=StorageType.MEMORY
            )
            assert ckpt.wait_latest_checkpoint(30)
            assert (tmp_path / "ckpt" / "latest").read_text() == str(step * 10)
            state = ckpt.load_checkpoint(resume_path=str(tmp_path / "ckpt"))
            assert_same(expected_state(step * 10), state)
    finally:
        ckpt.close()
