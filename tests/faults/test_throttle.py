"""The slow fault's throttles on real processes: a CPU quota cgroup and the SIGSTOP/SIGCONT cycle."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dlrover.constants import ENV_THROTTLE
from dlrover.faults import parse_faults, throttle
from dlrover.faults.throttle import (
    QuotaThrottle,
    SlowFaults,
    SlowWorker,
    StopCycleThrottle,
    make_throttle,
    slow_workers,
)

SPIN = "import os\nos.setsid()\nwhile True: pass\n"


def test_slow_faults_pick_the_ranks_of_the_node_and_multiply() -> None:
    faults = parse_faults("slow:node=1:factor=3;slow:rank=3:step=5:factor=2;kill:rank=2:step=1")
    assert slow_workers(faults, [2, 3], 0, (1, 0)) == [
        SlowWorker(2, 3.0, 0),
        SlowWorker(3, 3.0, 0),
        SlowWorker(3, 6.0, 5),
    ]
    assert slow_workers(faults, [2, 3], 0, (1, 1)) == [SlowWorker(3, 2.0, 5)]  # a replacement
    # Two faults on one rank from different steps: the second multiplies from its own step on.
    twice = parse_faults("slow:rank=0:step=4:factor=3;slow:rank=0:step=9:factor=2")
    assert slow_workers(twice, [0], 0, None) == [SlowWorker(0, 3.0, 4), SlowWorker(0, 6.0, 9)]
    assert slow_workers(faults, [0, 1], 0, (0, 0)) == []
    assert slow_workers(faults, [2, 3], 1, (1, 0)) == []  # restart 0 only, by default


def _cpu_share(proc: subprocess.Popen[bytes], seconds: float) -> float:
    """Cores the process used over ``seconds`` of wall time."""
    ps = psutil.Process(proc.pid)
    before, start = sum(ps.cpu_times()[:2]), time.monotonic()
    time.sleep(seconds)
    return (sum(ps.cpu_times()[:2]) - before) / (time.monotonic() - start)


@pytest.mark.parametrize("kind", ["quota", "stop"])
def test_a_throttled_spinning_process_gets_at_most_its_share(kind: str) -> None:
    """Factor 4: the spinner gets at most about a quarter of a core (a loaded machine can only
    give it less); after close it runs freely again and is not left stopped."""
    if kind == "quota" and QuotaThrottle.detect() is None:
        pytest.skip("no writable cgroup v1 cpu controller here")
    proc = subprocess.Popen([sys.executable, "-c", SPIN])
    slow = make_throttle(kind)
    try:
        time.sleep(0.3)  # its setsid ran: the stop cycle signals its group
        slow.add(proc.pid, 7, 4.0)
        assert 0.0 < _cpu_share(proc, 1.5) < 0.4
        slow.close()
        assert psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED
        assert not list(Path("/sys/fs/cgroup/cpu").glob(f"**/dlrover-slow-{os.getpid()}-7"))
    finally:
        slow.close()
        proc.kill()
        proc.wait(10)


def test_slow_faults_wait_for_their_step_and_release_everything() -> None:
    proc = subprocess.Popen([sys.executable, "-c", SPIN])
    slow = SlowFaults("slow:rank=5:step=3:factor=4")
    os.environ[ENV_THROTTLE] = "stop"
    try:
        time.sleep(0.3)
        slow.start_attempt(4, {0: os.getpid(), 1: proc.pid}, 0, None)
        slow.tick(2)
        assert slow._throttle is None  # not due before step 3
        slow.tick(3)
        assert isinstance(slow._throttle, StopCycleThrottle)
        assert _cpu_share(proc, 1.0) < 0.4
        slow.release()
        assert slow._throttle is None
        assert psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED
    finally:
        del os.environ[ENV_THROTTLE]
        slow.release()
        proc.kill()
        proc.wait(10)


def test_a_bad_throttle_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="DLROVER_THROTTLE='fast': use quota, stop"):
        make_throttle("fast")


def test_sweep_removes_the_cgroups_of_a_dead_agent_only() -> None:
    quota = QuotaThrottle.detect()
    if quota is None:
        pytest.skip("no writable cgroup v1 cpu controller here")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = quota._parent / f"{throttle.PREFIX}{dead.pid}-0"
    mine = quota._parent / f"{throttle.PREFIX}{os.getpid()}-0"
    left.mkdir()
    mine.mkdir()
    try:
        assert throttle.sweep() == 1
        assert not left.exists() and mine.exists()
    finally:
        for d in (left, mine):
            if d.exists():
                d.rmdir()
