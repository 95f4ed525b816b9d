"""Fault injection: parsing, and each kind firing in a real training-loop subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlrover.faults import pending_until
from dlrover.testing.faults import (
    Fault,
    FaultInjector,
    FaultKind,
    FaultSpecError,
    parse_faults,
)
from tests.conftest import small_tmpfs

REPO = Path(__file__).resolve().parents[2]
STEP_S = 0.05

LOOP = f"""
import json, sys, time
from dlrover.testing.faults import maybe_inject
durations = []
for step in range(8):
    began = time.monotonic()
    maybe_inject(step)
    time.sleep({STEP_S})
    durations.append(time.monotonic() - began)
    print("done", step, flush=True)
print(json.dumps(durations), flush=True)
"""


def test_parse_every_kind() -> None:
    faults = parse_faults(
        "kill:rank=1:step=5:restart=0; raise:rank=0:step=3:restart=*;"
        "hang:rank=1:step=4:seconds=0.5;slow:rank=1:factor=3;exit:step=2:code=7;"
        "kill_agent:rank=0:step=9:restart=2;kill_master:step=4:restart=*;"
    )
    assert faults == (
        Fault(FaultKind.KILL, step=5, rank=1, restart=0),
        Fault(FaultKind.RAISE, step=3, rank=0, restart=None),
        Fault(FaultKind.HANG, step=4, rank=1, seconds=0.5),
        Fault(FaultKind.SLOW, step=0, rank=1, factor=3.0),
        Fault(FaultKind.EXIT, step=2, code=7),
        Fault(FaultKind.KILL_AGENT, step=9, rank=0, restart=2),
        Fault(FaultKind.KILL_MASTER, step=4, restart=None),
    )
    assert parse_faults("") == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("explode:step=1", "unknown fault kind 'explode'; use one of kill, raise"),
        ("kill:rank=1", "kill needs step=N"),
        ("kill:step=x", "step='x' is not an integer"),
        ("kill:step=-1", "step must be >= 0"),
        ("kill:step=1:code=3", "bad field 'code=3'; kill takes node, once, rank, restart, step"),
        ("slow:rank=1", "slow needs factor=X"),
        ("slow:factor=0.5", "factor must be >= 1.0"),
        ("kill:step", "bad field 'step'"),
        ("pending:node=2", "pending needs until=PATH"),
    ],
)
def test_parse_errors_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(FaultSpecError, match=message.replace("(", r"\(")):
        parse_faults(text)


def test_pending_holds_only_the_replacements_of_its_slot() -> None:
    spec = "kill_agent:rank=4:step=6;pending:node=2:until=/tmp/room"
    assert pending_until(spec, (2, 1)) == "/tmp/room"
    assert pending_until(spec, (2, 3)) == "/tmp/room"
    assert pending_until(spec, (2, 0)) == ""  # the first attempt starts at once
    assert pending_until(spec, (1, 1)) == ""
    assert pending_until(spec, None) == ""
    assert pending_until("pending:until=/tmp/room", (1, 1)) == "/tmp/room"  # any slot's


def test_faults_filter_by_rank_and_restart() -> None:
    faults = parse_faults("kill:rank=1:step=5;raise:step=3:restart=*;exit:step=1:restart=1")
    assert [f.kind for f in FaultInjector(faults, 1, 0).faults] == [FaultKind.KILL, FaultKind.RAISE]
    assert [f.kind for f in FaultInjector(faults, 0, 1).faults] == [FaultKind.RAISE, FaultKind.EXIT]


def test_slow_sleeps_factor_minus_one_step_times() -> None:
    now = [0.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    injector = FaultInjector(parse_faults("slow:step=2:factor=3"), 0, 0, lambda: now[0], sleep)
    for step in range(5):
        injector.maybe_inject(step)
        now[0] += 1.0  # the step's own work
    assert slept == [2.0, 2.0, 2.0]  # steps 2, 3, 4; the injected sleep is not counted as work


def _run(faults: str, rank: int = 1, restart: int = 0, **extra: str):  # type: ignore[no-untyped-def]
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        DLROVER_FAULTS=faults,
        RANK=str(rank),
        TORCHELASTIC_RESTART_COUNT=str(restart),
        **extra,
    )
    return subprocess.Popen(
        [sys.executable, "-c", LOOP],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[int, list[str], str]:
    stdout, stderr = proc.communicate(timeout=30)
    done = [line for line in stdout.splitlines() if line.startswith("done")]
    return proc.returncode, done, stderr


def test_kill_fires_only_on_its_rank_and_restart() -> None:
    returncode, done, stderr = _finish(_run("kill:rank=1:step=5"))
    assert returncode == -signal.SIGKILL
    assert done[-1] == "done 4"
    assert "dlrover fault injection: kill rank 1 step 5" in stderr
    for rank, restart in ((0, 0), (1, 1)):
        returncode, done, _ = _finish(_run("kill:rank=1:step=5", rank=rank, restart=restart))
        assert (returncode, len(done)) == (0, 8)


def test_raise_and_exit_code() -> None:
    returncode, done, stderr = _finish(_run("raise:step=3"))
    assert (returncode, done[-1]) == (1, "done 2")
    assert "InjectedFault: injected fault at step 3 on rank 1" in stderr
    returncode, done, _ = _finish(_run("exit:step=2:code=7"))
    assert (returncode, done[-1]) == (7, "done 1")


def test_hang_blocks_until_killed_and_bounded_hang_resumes() -> None:
    proc = _run("hang:rank=1:step=4")
    try:
        assert proc.stderr is not None
        assert proc.stderr.readline() == "dlrover fault injection: hang rank 1 step 4\n"
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)  # still blocked a second later
    finally:
        proc.kill()
    returncode, done, _ = _finish(proc)
    assert (returncode, done[-1]) == (-signal.SIGKILL, "done 3")
    started = time.monotonic()
    returncode, done, _ = _finish(_run("hang:step=4:seconds=0.5"))
    assert (returncode, len(done)) == (0, 8)
    assert time.monotonic() - started >= 0.5


def test_slow_rank_takes_factor_times_longer() -> None:
    proc = _run("slow:rank=1:step=1:factor=3")
    stdout, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    durations = json.loads(stdout.splitlines()[-1])
    # Step 0 is measured, later steps sleep 2x the measured work on top of it.
    assert min(durations[2:]) >= 3 * STEP_S


def test_once_fires_a_fault_only_the_first_time_anywhere(tmp_path) -> None:
    from dlrover.testing.faults import parse_faults

    marker = tmp_path / "fired"
    [fault] = parse_faults(f"raise:step=2:once={marker}")
    assert fault.claim() and marker.exists()
    assert not fault.claim()  # a replacement worker with the same restart count does not repeat it


def test_kill_master_sigkills_the_pid_of_the_jobs_submit_record(tmp_path: Path) -> None:
    master = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        home = {"DLROVER_HOME": str(tmp_path), "DLROVER_JOB_NAME": "j"}
        path = tmp_path / "jobs" / "j" / "job.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"name": "j", "state": "running", "pid": master.pid}))
        returncode, done, stderr = _finish(_run("kill_master:step=2", **home))
        assert (returncode, len(done)) == (0, 8)  # the worker goes on; the master is gone
        assert master.wait(10) == -signal.SIGKILL
        assert "dlrover fault injection: kill_master rank 1 step 2" in stderr
    finally:
        master.kill()
        master.wait(10)


def test_kill_master_without_a_submit_record_says_what_it_needs(tmp_path: Path) -> None:
    returncode, done, stderr = _finish(
        _run("kill_master:step=2", DLROVER_HOME=str(tmp_path), DLROVER_JOB_NAME="absent")
    )
    assert (returncode, done[-1]) == (1, "done 1")
    assert "kill_master needs a job of `dlrover submit`: no job named 'absent'" in stderr


def test_fill_disk_fills_the_filesystem_then_frees_it_from_a_process_of_its_own(
    tmp_path: Path,
) -> None:
    small = tmp_path / "small"
    small_tmpfs(small, "4m")
    try:
        proc = _run(f"fill_disk:rank=1:step=2:seconds=3:path={small}")
        returncode, done, stderr = _finish(proc)
        assert (returncode, len(done)) == (0, 8)  # the worker goes on; the disk is full
        assert "dlrover fault injection: fill_disk rank 1 step 2" in stderr
        [filler] = list(small.iterdir())
        with pytest.raises(OSError, match="No space left on device"):
            (small / "one-more").write_bytes(b"\0" * 8192)
        deadline = time.monotonic() + 30
        while filler.exists():  # removed by a detached process: nothing to wait on but the file
            assert time.monotonic() < deadline, "the filler was never removed"
            time.sleep(0.05)
        # Room again. The kernel may free the file's pages a moment after its name is gone (seen
        # here: 1 write in 30 refused right after, the space back 10 ms later): asked until then.
        while True:
            try:
                (small / "one-more").write_bytes(b"\0" * 8192)
                break
            except OSError as e:
                assert time.monotonic() < deadline, f"the filler's space never came back: {e}"
                time.sleep(0.05)
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_fill_disk_needs_a_path() -> None:
    with pytest.raises(FaultSpecError, match="fill_disk needs path=DIR"):
        parse_faults("fill_disk:step=2")
