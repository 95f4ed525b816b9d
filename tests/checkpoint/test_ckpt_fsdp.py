"""FSDP2 (fully_shard) on CPU/gloo: sharded flash checkpoints, DCP on storage, resharding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.checkpoint.harness import (
    assert_same,
    free_port,
    run_workers,
    running_saver,
    worker_env,
)


def _envs(socket_path: str, world: int, restart: int = 0, **extra: str) -> list[dict[str, str]]:
    port = free_port()
    return [
        {**worker_env(socket_path, rank=r, world=world, port=port, restart=restart), **extra}
        for r in range(world)
    ]


@pytest.mark.e2e
def test_sharded_save_load_memory_storage_dcp_and_other_world_sizes(tmp_path: Path) -> None:
    ckpt, oracle = str(tmp_path / "ckpt"), str(tmp_path / "oracle.pt")
    with running_saver(tmp_path) as saver:
        run_workers(["fsdp_save", ckpt, "5", oracle], _envs(saver.socket_path, 2), timeout=120)
        assert saver.held_steps() == {0: 5, 1: 5}
        step_dir = tmp_path / "ckpt" / "step_5"
        assert (step_dir / ".metadata").exists()
        assert sorted(p.name for p in step_dir.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        # Same world size after a restart: every rank loads its own shards from memory.
        run_workers(
            ["fsdp_load", ckpt, "5", oracle, "memory"],
            _envs(saver.socket_path, 2, restart=1),
            timeout=120,
        )

    # Plain DCP, no process group, no DLRover: the step directory is a DCP checkpoint.
    expected = torch.load(oracle, weights_only=True)
    target: dict[str, dict[str, Any]] = {
        "model": {k: torch.empty_like(v) for k, v in expected["model"].items()},
        "extra": {"step": None},
    }
    dcp.load(target, checkpoint_id=str(tmp_path / "ckpt" / "step_5"))
    assert_same(expected["model"], target["model"])
    assert target["extra"]["step"] == 5

    with running_saver(tmp_path) as fresh:  # new agents: resume from storage, resharded
        for world in (1, 3):
            run_workers(
                ["fsdp_load", ckpt, "5", oracle, "storage"],
                _envs(fresh.socket_path, world, restart=2),
                timeout=120,
            )


@pytest.mark.e2e
def test_full_state_checkpointer_round_trip(tmp_path: Path) -> None:
    ckpt, oracle = str(tmp_path / "ckpt"), str(tmp_path / "oracle.pt")
    with running_saver(tmp_path) as saver:
        run_workers(
            ["fsdp_save", ckpt, "3", oracle, "full"], _envs(saver.socket_path, 2), timeout=120
        )
        assert (tmp_path / "ckpt" / "step_3" / "rank_0.bin").exists()
        run_workers(
            ["fsdp_load", ckpt, "3", oracle, "memory", "full"],
            _envs(saver.socket_path, 2, restart=1),
            timeout=120,
        )
    with running_saver(tmp_path) as fresh:
        run_workers(
            ["fsdp_load", ckpt, "3", oracle, "storage", "full"],
            _envs(fresh.socket_path, 2, restart=2),
            timeout=120,
        )


@pytest.mark.e2e
def test_fsdp1_sharded_tensor_state_saves_and_loads(tmp_path: Path) -> None:
    """FSDP1 wrapped without a device mesh (DLRover's nanoGPT example): ShardedTensor state, from
    memory after a restart, and from storage (a DCP checkpoint) at the same and another world
    size."""
    ckpt, oracle = str(tmp_path / "ckpt"), str(tmp_path / "oracle.pt")
    with running_saver(tmp_path) as saver:
        run_workers(
            ["fsdp_save", ckpt, "4", oracle], _envs(saver.socket_path, 2, FSDP_VERSION="1"), 120
        )
        run_workers(
            ["fsdp_load", ckpt, "4", oracle, "memory"],
            _envs(saver.socket_path, 2, restart=1, FSDP_VERSION="1"),
            timeout=120,
        )
    expected = torch.load(oracle, weights_only=True)
    target: dict[str, Any] = {
        "model": {k: torch.empty_like(v) for k, v in expected["model"].items()}
    }
    dcp.load(target, checkpoint_id=str(tmp_path / "ckpt" / "step_4"))
    assert_same(expected["model"], target["model"])
    with running_saver(tmp_path) as fresh:
        for world, restart in ((2, 2), (1, 3)):
            run_workers(
                ["fsdp_load", ckpt, "4", oracle, "storage"],
                _envs(fresh.socket_path, world, restart=restart, FSDP_VERSION="1"),
                timeout=120,
            )


@pytest.mark.e2e
def test_fsdp1_full_state_checkpointer_round_trip(tmp_path: Path) -> None:
    """FsdpFullCheckpointer on an FSDP1 CPU model (DLRover's nanoGPT with --flash_full_ckpt)."""
    ckpt, oracle = str(tmp_path / "ckpt"), str(tmp_path / "oracle.pt")
    with running_saver(tmp_path) as saver:
        envs = _envs(saver.socket_path, 2, FSDP_VERSION="1")
        run_workers(["fsdp_save", ckpt, "3", oracle, "full"], envs, timeout=120)
        run_workers(
            ["fsdp_load", ckpt, "3", oracle, "memory", "full"],
            _envs(saver.socket_path, 2, restart=1, FSDP_VERSION="1"),
            timeout=120,
        )


@pytest.mark.e2e
def test_a_rank_that_cannot_load_the_voted_memory_step_sends_every_rank_to_storage(
    tmp_path: Path,
) -> None:
    """Step 5 in memory, step 3 on storage; rank 1's shared memory vanishes after the saver
    counted it (the vote still says 5). Rank 0 could load 5 from memory, rank 1 only 3 from
    storage: every rank must resume from step 3, never a mix."""
    ckpt, oracle = str(tmp_path / "ckpt"), str(tmp_path / "oracle.pt")
    with running_saver(tmp_path) as saver:
        run_workers(
            ["fsdp_save_disk_then_memory", ckpt, oracle], _envs(saver.socket_path, 2), timeout=120
        )
        assert saver.held_steps() == {0: 5, 1: 5}
        rank1 = [p for p in Path("/dev/shm").iterdir() if saver.shm_prefix in p.name]
        rank1 = [p for p in rank1 if "slot1" in p.name]
        assert rank1, "rank 1's segments were not found"
        for path in rank1:
            path.unlink()
        run_workers(
            ["fsdp_load", ckpt, "3", oracle, "storage"],
            _envs(saver.socket_path, 2, restart=1),
            timeout=120,
        )
