"""What each test costs in CPU-seconds, beside pytest's wall-clock durations.

A stage's wall time on CI's 2 cores is set by the CPU its tests spend as much as by their waits;
the slowest tests are not always the costliest. Each test's cost is the CPU its pytest process
and every process it started and waited for spent from its set-up to its tear-down
(``getrusage`` of the process and of its reaped children). A fixture shared by several tests
counts for the first that uses it; a process a test leaves running is not counted (the leftover
checks catch those). The run's last sections: the 30 costliest tests, and the stage's total.
"""

from __future__ import annotations

import resource
from collections.abc import Generator
from typing import Any

import pytest

from tests.stages import float_property

_KEY = "cpu_s"
_START = pytest.StashKey[float]()
SHOWN = 30


def cpu_now() -> float:
    """CPU-seconds of this process and its reaped descendants so far."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class CpuCost:
    """Measures each test where it runs (in an xdist worker too: the figure travels back in the
    tear-down report's ``user_properties``) and prints the costliest at the run's end."""

    def __init__(self) -> None:
        self.costs: list[tuple[float, str]] = []

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, Any, None]:
        item.stash[_START] = cpu_now()
        yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, Any, None]:
        outcome = yield
        report: pytest.TestReport = outcome.get_result()
        if report.when == "teardown" and _START in item.stash:
            report.user_properties.append((_KEY, cpu_now() - item.stash[_START]))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        seconds = float_property(report, _KEY)
        if seconds is not None:
            self.costs.append((seconds, report.nodeid))

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if len(self.costs) < 2:
            return
        total = sum(seconds for seconds, _ in self.costs)
        terminalreporter.write_sep("=", f"costliest {SHOWN} tests in CPU-seconds")
        for seconds, nodeid in sorted(self.costs, reverse=True)[:SHOWN]:
            terminalreporter.write_line(f"{seconds:7.2f} CPU-s {nodeid}")
        terminalreporter.write_line(
            f"{total:.1f} CPU-s in all over {len(self.costs)} tests "
            "(each test's own process and the processes it reaped)"
        )
