"""Failures during flash checkpointing: nothing complete is lost, errors say what to do."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dlrover.checkpoint.client import SaverClient
from dlrover.checkpoint.config import ENV_CHECKPOINT_SOCKET
from dlrover.checkpoint.engine import CheckpointEngine, WorkerPlacement
from dlrover.checkpoint.errors import CheckpointStorageError, SaverError, ShmSpaceError
from dlrover.checkpoint.saver_messages import (
    AllocateRequest,
    BeginCopyRequest,
    CopiedRequest,
    PersistSpec,
)
from dlrover.checkpoint.shm import shm_free_bytes
from dlrover.testing.faults import fill_disk
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer
from tests.checkpoint.harness import (
    REPO,
    kill,
    run_workers,
    running_saver,
    start_worker,
    wait_for_file,
    worker_env,
)
from tests.conftest import small_tmpfs


def test_worker_killed_mid_copy_loads_previous_step_from_memory(tmp_path: Path) -> None:
    """The torn copy went into the slot's other buffer: the previous step stays in memory."""
    ckpt, marker = str(tmp_path / "ckpt"), tmp_path / "mid-copy"
    with running_saver(tmp_path) as saver:
        worker = start_worker(
            ["ddp_save_then_die_mid_copy", ckpt, "1", "2", str(marker)],
            worker_env(saver.socket_path),
        )
        wait_for_file(marker, 60, worker)
        kill(worker)
        assert saver.held_steps() == {0: 1}  # the torn copy is not a step; step 1 is intact
        assert saver.persist_latest_if_newer() is None  # storage has step 1 already
        run_workers(["ddp_load", ckpt, "1", "memory"], [worker_env(saver.socket_path, restart=1)])


@pytest.mark.e2e
def test_saver_killed_mid_persist_keeps_previous_step(tmp_path: Path) -> None:
    ckpt, marker = str(tmp_path / "ckpt"), tmp_path / "mid-persist"
    sock, prefix = str(tmp_path / "agent.sock"), f"dlrtest-{uuid.uuid4().hex[:8]}"
    agent = subprocess.Popen(
        [sys.executable, "-m", "tests.checkpoint.saver_proc", sock, prefix, "2", str(marker)],
        cwd=REPO,
        env=worker_env(None),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert agent.stdout is not None and agent.stdout.readline().strip() == b"ready"
        run_workers(["ddp_save", ckpt, "1", "disk"], [worker_env(sock)])
        run_workers(["ddp_save", ckpt, "2", "memory"], [worker_env(sock)])
    except BaseException:
        kill(agent)
        raise
    # Step 2 only reaches storage through a persist; ask for one and kill the agent in it.
    client = SaverClient(sock)
    spec = PersistSpec(ckpt, {0: 0}, "plain", node_rank=0, persist_nodes=1, keep_last=3)
    client.request(CopiedRequest(0, 2, spec, persist=True))
    wait_for_file(marker, 60)
    kill(agent)
    client.close()
    for leftover in Path("/dev/shm").glob(f"{prefix}-*"):
        leftover.unlink()
    root = tmp_path / "ckpt"
    assert (root / "latest").read_text() == "1"
    assert not (root / "step_2" / "manifest.json").exists()
    with running_saver(tmp_path) as fresh:
        run_workers(["ddp_load", ckpt, "1", "storage"], [worker_env(fresh.socket_path)])
        run_workers(["ddp_save", ckpt, "3", "disk"], [worker_env(fresh.socket_path)])
    assert (root / "latest").read_text() == "3"
    assert not (root / "step_2").exists()  # the torn step was collected once 3 committed


def test_corrupt_file_warns_and_falls_back_to_previous_step(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    with running_saver(tmp_path) as saver:
        for step in ("1", "2"):
            run_workers(["ddp_save", ckpt, step, "disk"], [worker_env(saver.socket_path)])
    data = tmp_path / "ckpt" / "step_2" / "rank_0.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF
    data.write_bytes(bytes(raw))
    (tmp_path / "ckpt" / "step_3").mkdir()  # a partial step newer than latest: ignored
    (tmp_path / "ckpt" / "step_3" / "rank_0.bin").write_bytes(b"partial")
    with running_saver(tmp_path) as fresh:
        worker = start_worker(["ddp_load", ckpt, "1", "storage"], worker_env(fresh.socket_path))
        out, _ = worker.communicate(timeout=60)
    text = out.decode()
    assert worker.returncode == 0, text
    assert "step 2 is unusable" in text and "rank_0.bin is corrupt" in text
    assert data.exists()  # nothing deleted: an operator can still inspect it


def test_unwritable_checkpoint_dir_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointStorageError, match="checkpoint directory .*a-file"):
        DdpCheckpointer(str(blocker / "ckpt"))


def test_failed_persist_is_reported_and_memory_and_storage_survive(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    with running_saver(tmp_path) as saver:
        env = worker_env(saver.socket_path)
        run_workers(["ddp_save", ckpt, "1", "disk"], [env])
        (tmp_path / "ckpt" / "step_2").write_text("a file where the step directory goes")
        worker = start_worker(["ddp_save", ckpt, "2", "disk"], env)
        out, _ = worker.communicate(timeout=60)
        assert worker.returncode != 0
        assert "CheckpointStorageError" in out.decode()
        assert "still in memory" in out.decode()
        assert (tmp_path / "ckpt" / "latest").read_text() == "1"
        run_workers(["ddp_load", ckpt, "2", "memory"], [worker_env(saver.socket_path, restart=1)])
    with running_saver(tmp_path) as fresh:
        run_workers(["ddp_load", ckpt, "1", "storage"], [worker_env(fresh.socket_path)])


def test_too_little_shm_for_the_state_is_refused_and_memory_kept(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    with running_saver(tmp_path) as saver:
        run_workers(["ddp_save", ckpt, "1", "memory"], [worker_env(saver.socket_path)])
        client = SaverClient(saver.socket_path)
        wanted = shm_free_bytes() + 2**34
        with pytest.raises(ShmSpaceError, match="--shm-size") as info:
            client.request(AllocateRequest(0, wanted))
        client.close()
        assert info.value.free > 0 and info.value.needed > info.value.free
        assert saver.held_steps() == {0: 1}
        run_workers(["ddp_load", ckpt, "1", "memory"], [worker_env(saver.socket_path, restart=1)])


def test_manifest_lists_checksums(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    with running_saver(tmp_path) as saver:
        run_workers(["ddp_save", ckpt, "1", "disk"], [worker_env(saver.socket_path)])
    manifest = json.loads((tmp_path / "ckpt" / "step_1" / "manifest.json").read_text())
    assert manifest["step"] == 1 and manifest["format"] == "plain"
    assert set(manifest["files"]) == {"rank_0.bin", "rank_0.meta.json"}
    assert all("crc32" in v and "size" in v for v in manifest["files"].values())


def test_worker_failure_releases_a_persist_waiting_for_a_dead_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with running_saver(tmp_path) as saver:
        monkeypatch.setenv(ENV_CHECKPOINT_SOCKET, saver.socket_path)
        rank0 = CheckpointEngine(
            str(tmp_path / "ckpt"), "dcp", placement=WorkerPlacement(0, 0, 2, 2, 0, 0)
        )
        try:
            # Rank 1 dies before copying step 5, so that persist can never start.
            assert rank0.save(5, {"w": torch.ones(4)}, persist=True)
            assert rank0.save(6, {"w": torch.ones(4)}, persist=False)  # the other buffer
            client = SaverClient(saver.socket_path)
            ask = BeginCopyRequest(0, nbytes=1 << 16, step=7, persist=True, timeout=0.2)
            with pytest.raises(SaverError, match="no buffer became free for step 7"):
                client.request(ask)  # a DISK save waits: step 5's buffer is held for it
            assert saver.persist_latest_if_newer() is None  # the agent saw the failure
            client.request(replace(ask, timeout=5.0))  # released at once
            client.close()
            assert not (tmp_path / "ckpt" / "latest").exists()
        finally:
            rank0.close()


def test_a_failed_persist_does_not_fail_the_wait_for_a_later_step_that_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk for a while (the fault campaign's disk_full) fails one persist, said for its
    step; once there is room the next commits, and waiting for it succeeds (the agent's saver
    outlives the failure: it must not hold it against later steps)."""
    ckpt = tmp_path / "ckpt"
    with running_saver(tmp_path) as saver:
        monkeypatch.setenv(ENV_CHECKPOINT_SOCKET, saver.socket_path)
        engine = CheckpointEngine(str(ckpt), "plain", placement=WorkerPlacement(0, 0, 1, 1, 0, 0))
        try:
            (ckpt / "step_10").write_text("a file where the step directory goes")
            assert engine.save(10, {"w": torch.ones(4)}, persist=True)
            with pytest.raises(CheckpointStorageError, match="step 10: .*still in memory"):
                engine.wait_persisted(60)
            (ckpt / "step_10").unlink()  # the disk has room again
            assert engine.save(11, {"w": torch.full((4,), 2.0)}, persist=True)
            assert engine.wait_persisted(60)
            assert (ckpt / "latest").read_text() == "11"
        finally:
            engine.close()


def test_waiting_for_a_step_whose_disk_was_full_writes_it_again_once_there_is_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fault campaign's disk_full at the end of training: the last DISK save's persist
    finds no room, and the script's final `wait_latest_checkpoint(60)` used to raise, so the
    job failed (twice the same error: failing fast). While the wait lasts, the step, still in
    memory, is written again each second; once the disk has room it commits."""
    ckpt = tmp_path / "ckpt"
    small_tmpfs(ckpt, "4m")
    try:
        with running_saver(tmp_path) as saver:
            monkeypatch.setenv(ENV_CHECKPOINT_SOCKET, saver.socket_path)
            engine = CheckpointEngine(
                str(ckpt), "plain", placement=WorkerPlacement(0, 0, 1, 1, 0, 0)
            )
            try:
                filler = fill_disk(str(ckpt), 2.0)  # freed by a process of its own in 2 s
                state = {"w": torch.arange(64 * 1024, dtype=torch.float32)}  # 256 KiB
                assert engine.save(10, state, persist=True)
                assert engine.wait_persisted(60)
                assert not Path(filler).exists()
                assert (ckpt / "latest").read_text() == "10"
            finally:
                engine.close()
        monkeypatch.delenv(ENV_CHECKPOINT_SOCKET)  # the saver is gone: this reads storage
        loaded = DdpCheckpointer(str(ckpt)).load_checkpoint()
        assert torch.equal(loaded["w"], state["w"])
    finally:
        subprocess.run(["umount", "-l", str(ckpt)], check=False)
