"""The owner lock and the sweep of leftovers: only what a dead process owned is removed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from dlrover.checkpoint.leftovers import OwnerLock, label, owner_prefix, parse, sweep
from tests.checkpoint.harness import REPO

HOLDER = """
import os, sys
from dlrover.checkpoint.leftovers import OwnerLock, owner_prefix
shm, tmp, job = sys.argv[1:4]
prefix = owner_prefix(job, "node-0", os.getpid())
lock = OwnerLock(prefix, shm)
open(os.path.join(shm, prefix + ".ckpt-slot0-buf0"), "w").close()
os.makedirs(os.path.join(tmp, prefix + ".agent"))
print(prefix, flush=True)
sys.stdin.read()
"""


def _holder(shm: Path, tmp: Path, job: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(shm), str(tmp), job],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def _ours(where: Path, prefix: str) -> list[str]:
    return sorted(p.name for p in where.iterdir() if p.name.startswith(prefix))


def test_names_carry_job_node_and_pid_and_parse_back() -> None:
    prefix = owner_prefix("my job/2", "worker-0", 4242)
    assert prefix == "dlrover.my_job_2.worker-0.4242"
    owned = parse(f"{prefix}.ckpt-slot3-buf1")
    assert owned is not None and (owned.job, owned.node, owned.pid) == (
        "my_job_2",
        "worker-0",
        4242,
    )
    assert parse(f"{prefix}.lock") == owned
    assert parse("dlrover-bench-1234") is None and parse("dlrover.x") is None
    assert len(label("j" * 300)) == 24
    # The longest name stays well inside a file name (255) and a unix socket path (108).
    longest = owner_prefix("j" * 300, "n" * 300, 4_194_304) + ".ckpt-replica-n999-slot127"
    assert (
        len(longest) < 120
        and len(f"/tmp/{owner_prefix('j' * 99, 'n' * 99, 1)}.agent/ckpt.sock") < 100
    )


def test_sweep_removes_a_killed_owners_things_and_never_a_live_ones(tmp_path: Path) -> None:
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    job = f"sweep-{uuid.uuid4().hex[:6]}"
    alive, alive_prefix = _holder(shm, tmp, job)
    dead, dead_prefix = _holder(shm, tmp, job)
    other, other_prefix = _holder(shm, tmp, "another-job")
    try:
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait(10)
        other.kill()
        other.wait(10)
        assert len(_ours(shm, dead_prefix)) == 2 and _ours(tmp, dead_prefix)
        removed = sweep(str(shm), str(tmp), job=job)
        assert sorted(Path(p).name for p in removed) == sorted(
            [f"{dead_prefix}.ckpt-slot0-buf0", f"{dead_prefix}.agent", f"{dead_prefix}.lock"]
        )
        assert _ours(shm, dead_prefix) == [] and _ours(tmp, dead_prefix) == []
        # The live owner (same job, same node) keeps everything; the other job is not ours.
        assert len(_ours(shm, alive_prefix)) == 2 and _ours(tmp, alive_prefix)
        assert len(_ours(shm, other_prefix)) == 2
        sweep(str(shm), str(tmp))  # any job: now the other job's dead owner goes too
        assert _ours(shm, other_prefix) == [] and _ours(tmp, other_prefix) == []
        assert len(_ours(shm, alive_prefix)) == 2
    finally:
        for proc in (alive, dead, other):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    sweep(str(shm), str(tmp))
    assert list(shm.iterdir()) == [] and list(tmp.iterdir()) == []


def test_without_a_lock_file_the_pid_decides(tmp_path: Path) -> None:
    """An in-process saver has no lock file: a live PID keeps its segments."""
    live = owner_prefix("j", "rank0", os.getpid())
    gone = owner_prefix("j", "rank0", 2**22 + 17)  # above the default pid_max: no such process
    for prefix in (live, gone):
        (tmp_path / f"{prefix}.ab12.ckpt-slot0-buf0").touch()
    (tmp_path / f"dlrover-{2**22 + 18}-ckpt-slot0").touch()  # a name of the release before
    sweep(str(tmp_path), str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{live}.ab12.ckpt-slot0-buf0"]


def test_the_lock_is_released_last_and_only_once(tmp_path: Path) -> None:
    prefix = owner_prefix("j", "n", os.getpid())
    lock = OwnerLock(prefix, str(tmp_path))
    (tmp_path / f"{prefix}.ckpt-slot0-buf0").touch()
    assert sweep(str(tmp_path), str(tmp_path)) == []  # we hold it: we are alive
    lock.release()
    lock.release()
    assert not (tmp_path / f"{prefix}.lock").exists()


def test_the_old_releases_agent_folders_go_once_idle_for_a_day(tmp_path: Path) -> None:
    """`/tmp/dlrover_agent_*` of the release before names had owners: removed by the sweep at
    an agent's start once nothing in them changed for a day; a recent one (maybe a live old
    agent's) is kept, and a job's own sweep never touches them."""
    from dlrover.checkpoint.leftovers import LEGACY_TMP_IDLE_S

    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    old, recent = tmp / "dlrover_agent_ab12cd", tmp / "dlrover_agent_ef34gh"
    for folder in (old, recent):
        (folder / "steps").mkdir(parents=True)
        (folder / "steps" / "rank_0").write_text("7")
    stale = os.path.getmtime(old) - LEGACY_TMP_IDLE_S - 60
    for path in (old / "steps" / "rank_0", old / "steps", old):
        os.utime(path, (stale, stale))
    assert sweep(str(shm), str(tmp), job="some-job") == []
    assert sweep(str(shm), str(tmp)) == [str(old)]
    assert not old.exists() and (recent / "steps" / "rank_0").read_text() == "7"
