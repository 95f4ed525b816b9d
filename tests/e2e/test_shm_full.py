"""A node whose /dev/shm is full: flash checkpoints go to local disk instead, nothing is lost."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlrover.testing.faults import fill_disk
from tests.conftest import SCRIPTS, clean_env, dlrover_run, small_tmpfs

KILL_STEP = 13  # a memory-only step (storage every 5): the restart must find step 12 in memory


@pytest.fixture
def full_shm(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs, filled to the last page, that the job uses as its /dev/shm."""
    shm = tmp_path / "shm"
    small_tmpfs(shm, "4m")
    try:
        fill_disk(str(shm), float("inf"))
        yield shm
    finally:
        subprocess.run(["umount", "-l", str(shm)], check=False)


def _train(tmp: Path, name: str, **env: str) -> tuple[Path, str]:
    out = tmp / name
    spill = tmp / f"{name}-spill"
    spill.mkdir()
    r = dlrover_run(
        [
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=2",
            "--rdzv-id",
            f"shm-{name}",
            str(SCRIPTS / "flash_train.py"),
            "--steps",
            "20",
            "--ckpt",
            str(tmp / f"{name}-ckpt"),
            "--out",
            str(out),
        ],
        env=clean_env(DLROVER_CKPT_SPILL_DIR=str(spill), **env),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-6000:]
    return out, r.stderr


@pytest.mark.e2e
def test_a_job_whose_shm_is_full_saves_to_disk_and_resumes_from_that_memory(
    tmp_path: Path, full_shm: Path
) -> None:
    """Every save returns True (the script asserts it); a worker SIGKILLed after a memory-only
    save resumes from that step, kept in the spill folder; the final model equals a run on
    the machine's /dev/shm."""
    ref, _ = _train(tmp_path, "ref")
    killed, log = _train(
        tmp_path,
        "full",
        DLROVER_CKPT_SHM_DIR=str(full_shm),
        DLROVER_FAULTS=f"kill:rank=0:step={KILL_STEP}",
    )
    assert f"they are kept in {tmp_path / 'full-spill'} instead" in log, log[-4000:]
    assert Path(f"{killed}.final").read_text() == Path(f"{ref}.final").read_text()
    resumes = [x for x in Path(f"{killed}.steps").read_text().split("\n") if x.startswith("resume")]
    assert resumes == ["resume 1 None", f"resume {KILL_STEP} memory"]
    assert not list((tmp_path / "full-spill").iterdir())  # the agent freed what it spilled


def test_without_a_spill_folder_a_full_shm_fails_the_save_saying_what_to_do(
    tmp_path: Path, full_shm: Path
) -> None:
    r = dlrover_run(
        [
            "--standalone",
            "--nproc-per-node=1",
            "--max-restarts=0",
            "--rdzv-id",
            "shm-off",
            str(SCRIPTS / "flash_train.py"),
            "--steps",
            "3",
            "--ckpt",
            str(tmp_path / "ckpt"),
            "--out",
            str(tmp_path / "out"),
        ],
        env=clean_env(DLROVER_CKPT_SHM_DIR=str(full_shm), DLROVER_CKPT_SPILL_DIR="off"),
        timeout=300,
    )
    assert r.returncode != 0
    assert "ShmSpaceError" in r.stderr and "DLROVER_CKPT_SHM_DIR" in r.stderr, r.stderr[-4000:]
