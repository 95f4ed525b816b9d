"""The heartbeat's CPU and memory figures come from real processes (they were always 0% CPU
when each sample made a fresh psutil object)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from dlrover.processes import UsageMeter


def test_a_busy_process_shows_its_cpu_from_the_second_sample_on() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        meter, kernel = UsageMeter(), psutil.Process(busy.pid)
        first_cpu, first_mem = meter.sample([busy.pid, 999_999_999])  # a gone pid is skipped
        assert first_cpu == 0.0 and first_mem > 0
        used_before, started = sum(kernel.cpu_times()[:2]), time.monotonic()
        time.sleep(0.5)  # CPU percent is a rate: it needs time between two samples
        cpu, _ = meter.sample([busy.pid])
        # What the kernel counted for it meanwhile (on a busy machine well under a whole core).
        used = (sum(kernel.cpu_times()[:2]) - used_before) / (time.monotonic() - started) * 100
        assert cpu > 0 and cpu == pytest.approx(used, rel=0.5)
    finally:
        busy.kill()
        busy.wait()
