"""With default flags a stuck job is never silent: stuck ranks are logged with their stacks."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path

from dlrover.agent.progress_watch import ExitWatch, ProgressWatch
from tests.conftest import REPO, SCRIPTS, clean_env, run_cmd


def test_cpu_use_counts_as_progress_only_until_a_step_is_reported() -> None:
    watch = ProgressWatch(2, started_at=0.0)
    for now in range(1, 11):
        # rank 0 computes (a full core), rank 1 sleeps (no CPU), neither reports a step
        watch.observe(0, None, float(now), float(now))
        watch.observe(1, None, 0.0, float(now))
    assert [s.local_rank for s in watch.new_stalls(5.0, 10.0, finished=set())] == [1]
    assert watch.new_stalls(5.0, 11.0, finished=set()) == []  # one warning per stall
    # rank 0 reports a step once: from then on only steps count, however busy it is
    watch.observe(0, (1, 10.5), 11.0, 11.0)
    for now in range(12, 20):
        watch.observe(0, (1, 10.5), float(now), float(now))
    assert [s.local_rank for s in watch.new_stalls(5.0, 19.0, finished=set())] == [0]
    # progress re-arms the warning
    watch.observe(0, (2, 19.5), 20.0, 20.0)
    assert watch.new_stalls(5.0, 24.0, finished=set()) == []
    assert [s.step for s in watch.new_stalls(5.0, 26.0, finished=set())] == [2]


def test_exit_hang_needs_the_timeout_of_idleness_after_the_work_ended() -> None:
    watch = ExitWatch(timeout_s=10.0)
    watch.observe(0, cpu_s=5.0, now=100.0)  # the idle clock starts at the first sample
    watch.observe(1, cpu_s=5.0, now=100.0)
    ended = {0: 95.0, 1: 95.0}
    assert watch.hung(ended, now=109.0) == []
    watch.observe(1, cpu_s=5.5, now=109.0)  # still writing a checkpoint: not hung
    watch.observe(0, cpu_s=5.0, now=110.0)
    assert watch.hung(ended, now=110.0) == [0]
    assert watch.hung({0: 95.0, 1: 112.0}, now=118.9) == [0]  # 1 reported a step at 112
    assert watch.hung({0: 95.0, 1: 95.0}, now=119.0) == [0, 1]
    assert ExitWatch(timeout_s=0.0).hung(ended, now=1e9) == []  # 0 turns it off


def test_stuck_workers_are_logged_with_stacks_and_the_job_goes_on(tmp_path: Path) -> None:
    release = tmp_path / "release"
    proc = subprocess.Popen(
        [
            *run_cmd("dlrover.cli.run"),
            "--standalone",
            "--nproc-per-node=2",
            "--hang-warning-timeout=2",
            str(SCRIPTS / "stall.py"),
            str(release),
        ],
        env=clean_env(),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    warned = threading.Event()
    stalled: set[str] = set()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            # One warning for both ranks, or one each when a loaded machine starts them apart.
            match = re.search(r"no progress on rank\(s\) ([0-9, ]+) for", line)
            if match:
                stalled.update(r.strip() for r in match.group(1).split(","))
                if stalled >= {"0", "1"}:
                    warned.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    started = time.monotonic()
    try:
        assert warned.wait(30), "".join(lines)
        assert time.monotonic() - started < 20
        release.touch()  # the "hang" ends: the job was not restarted and finishes normally
        assert proc.wait(timeout=30) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    reader.join(timeout=10)
    log = "".join(lines)
    assert "never reported a step" in log
    # Both ranks' Python stacks, naming the function each one is stuck in.
    assert "--- rank 0 (pid" in log and "--- rank 1 (pid" in log
    assert log.count("in wait_for_release") >= 2
    assert "restarting workers" not in log
