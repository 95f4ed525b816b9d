"""Nothing of a job is left on the node once it ended: shared memory, temp folders, cgroups.

Each case runs flash_train.py (flash checkpoint in memory every step) under a job name of its
own and ends it one way: success, failure, SIGTERM/SIGINT, or the agent SIGKILLed (what it
could not remove goes at the next agent start on the node). Matched by the job's name in the
names (``dlrover.<job>.<node>.<pid>.*``), never by "everything named dlrover": other jobs on
this machine are running now.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from dlrover.checkpoint.leftovers import label
from dlrover.engines.cgroups import PREFIX as CGROUP_PREFIX
from dlrover.engines.cgroups import CgroupRoot
from tests.conftest import REPO, SCRIPTS, clean_env, dlrover_run
from tests.stalls import process_report

pytestmark = pytest.mark.e2e


def _job(case: str) -> str:
    return f"left-{case}-{uuid.uuid4().hex[:6]}"


def _leftovers(job: str) -> list[str]:
    """Everything on this machine named for ``job``: segments, locks, temp folders, cgroups."""
    tag = f"dlrover.{label(job)}."
    found = [
        str(p)
        for where in (Path("/dev/shm"), Path(tempfile.gettempdir()))
        for p in where.iterdir()
        if p.name.startswith(tag)
    ]
    cgroups = Path("/sys/fs/cgroup")
    if cgroups.is_dir():
        found += [
            str(p) for p in cgroups.rglob(f"{CGROUP_PREFIX}*") if p.is_dir() and job in p.name
        ]
    return found


def _train_args(tmp: Path, job: str, steps: int) -> list[str]:
    (tmp / f"{job}-ckpt").mkdir()
    return [
        str(SCRIPTS / "flash_train.py"),
        "--steps",
        str(steps),
        "--disk-every",
        "4",
        "--step-time",
        "0.05",
        "--ckpt",
        str(tmp / f"{job}-ckpt"),
        "--out",
        str(tmp / job),
    ]


def _run_args(tmp: Path, job: str, steps: int) -> list[str]:
    return [
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=0",
        "--rdzv-id",
        job,
        *_train_args(tmp, job, steps),
    ]


def _submit_cmd(tmp: Path, job: str, steps: int, restarts: int = 0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dlrover.cli.job",
        "submit",
        "--name",
        job,
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        "--memory",
        "6Gi",  # a cgroup per node where this machine lets the engine make one
        "--relaunch-delay",
        "0",
        *_train_args(tmp, job, steps),
    ]


def _wait_steps(tmp: Path, job: str, n: int, proc: subprocess.Popen[bytes]) -> None:
    """Until rank 0 logged ``n`` steps (so memory holds a checkpoint), with a deadline."""
    steps = tmp / f"{job}.steps"
    deadline = time.monotonic() + 120
    while True:
        done = [x for x in steps.read_text().split()] if steps.exists() else []
        if sum(1 for x in done if x.isdigit()) >= n:
            return
        assert proc.poll() is None, f"the job ended early with {proc.returncode}"
        assert time.monotonic() < deadline, (
            f"{job}: fewer than {n} steps in 120 s\n{process_report()}"
        )
        time.sleep(0.2)


def _kill_orphans(marker: str) -> None:
    """Workers of a SIGKILLed dlrover-run outlive it (their agent is gone): end them, by pid."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline and int(pid) != os.getpid():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_dlrover_run_leaves_nothing_on_success_failure_and_signals(tmp_path: Path):
    ok = _job("run-ok")
    r = dlrover_run(_run_args(tmp_path, ok, 6), env=clean_env(), timeout=180)
    assert r.returncode == 0, r.stderr[-4000:]
    assert _leftovers(ok) == []

    failed = _job("run-fail")
    r = dlrover_run(
        _run_args(tmp_path, failed, 12),
        env=clean_env(DLROVER_FAULTS="raise:rank=0:step=4"),
        timeout=180,
    )
    assert r.returncode != 0
    assert _leftovers(failed) == []

    for signum in (signal.SIGTERM, signal.SIGINT):
        job = _job(f"run-{signal.Signals(signum).name.lower()}")
        proc = subprocess.Popen(
            [sys.executable, "-m", "dlrover.cli.run", *_run_args(tmp_path, job, 10_000)],
            env=clean_env(),
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            _wait_steps(tmp_path, job, 3, proc)
            assert _leftovers(job)  # the segments exist while it runs
            proc.send_signal(signum)
            assert proc.wait(60) == 128 + signum
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        assert _leftovers(job) == []


def test_dlrover_run_agent_sigkilled_is_swept_at_the_next_agent_start(tmp_path: Path):
    job = _job("run-agentkill")
    try:
        r = dlrover_run(
            _run_args(tmp_path, job, 12),
            env=clean_env(DLROVER_FAULTS="kill_agent:rank=0:step=4"),
            timeout=180,
        )
        assert r.returncode == -signal.SIGKILL, r.stderr[-4000:]
    finally:
        _kill_orphans(str(tmp_path / f"{job}-ckpt"))
    left = _leftovers(job)
    assert any("/dev/shm/" in p for p in left), left  # what a SIGKILLed agent cannot remove
    nxt = _job("run-next")
    r = dlrover_run(_run_args(tmp_path, nxt, 2), env=clean_env(), timeout=180)
    assert r.returncode == 0, r.stderr[-4000:]
    assert _leftovers(job) == [] and _leftovers(nxt) == []


@pytest.mark.long
def test_dlrover_submit_leaves_nothing_on_success_failure_sigterm_and_agent_kill(
    tmp_path: Path,
):
    home = tmp_path / "home"
    env = clean_env(DLROVER_HOME=str(home))

    def submit(job: str, steps: int, faults: str = "", restarts: int = 0) -> int:
        r = subprocess.run(
            _submit_cmd(tmp_path, job, steps, restarts),
            env={**env, "DLROVER_FAULTS": faults},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        return r.returncode

    ok = _job("sub-ok")
    assert submit(ok, 6) == 0
    assert _leftovers(ok) == []

    failed = _job("sub-fail")
    assert submit(failed, 12, faults="raise:rank=0:step=4") != 0
    assert _leftovers(failed) == []

    # The node's agent is SIGKILLed at step 4; the relaunched node's agent sweeps what it left.
    agent_killed = _job("sub-agentkill")
    once = tmp_path / "killed-once"
    assert submit(agent_killed, 10, faults=f"kill_agent:rank=0:step=4:once={once}", restarts=2) == 0
    assert once.exists()  # the fault did fire
    assert _leftovers(agent_killed) == []

    for signum in (signal.SIGTERM, signal.SIGINT):
        job = _job(f"sub-{signal.Signals(signum).name.lower()}")
        log_path = tmp_path / f"{job}.log"
        log = open(log_path, "w")  # noqa: SIM115 - a pipe nobody reads would block it
        proc = subprocess.Popen(
            _submit_cmd(tmp_path, job, 10_000),
            env=env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_steps(tmp_path, job, 3, proc)
            running = _leftovers(job)
            assert any("/dev/shm/" in p for p in running), running
            if CgroupRoot.detect()[0] is not None:  # the node's cgroup is the job's too
                assert any(p.startswith("/sys/fs/cgroup") for p in running), running
            proc.send_signal(signum)
            proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
            log.close()
        assert _leftovers(job) == [], log_path.read_text()[-4000:]
