"""The test stages (README, "Testing"): which stage a test belongs to, and the fast stage's limit.

A test carries at most one stage marker (`e2e`, `extras`, `campaign`); a test with none is in the
fast stage, the README's test command, which must stay far inside its 10 minutes. A fast-stage
test that takes over `FAST_STAGE_LIMIT_S` (set-up, call and tear-down; longer in proportion while
the machine is busier than its cores) fails the run at its end, named with its time: make it
faster, or mark it `e2e` if it is a whole job.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

STAGE_MARKERS = ("e2e", "extras", "campaign")
FAST_STAGE_LIMIT_S = 20.0


def stage_of(item: pytest.Item) -> list[str]:
    """The stage markers ``item`` carries (markers only: its keywords also hold the names of its
    folders, and tests/e2e/ is one)."""
    names = {mark.name for mark in item.iter_markers()}
    return [name for name in STAGE_MARKERS if name in names]


def busy_factor() -> float:
    """How many times more runnable work than cores the machine has (1-minute load average,
    at least 1): the limit is for a stage that runs alone (CI), and stretches by this factor
    while another stage runs beside it, which slows every test alike."""
    cores = os.cpu_count() or 1
    return max(1.0, os.getloadavg()[0] / cores)


class StageCheck:
    """Refuses a test in two stages at collection. A fast-stage test whose phases add up to over
    the limit gets an error at its tear-down (where it ran, so under xdist too), and the run's
    last section lists every such test by name."""

    def __init__(self) -> None:
        self.over: list[tuple[float, str]] = []

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        doubled = [
            f"{item.nodeid}: {' and '.join(names)}"
            for item in items
            if len(names := stage_of(item)) > 1
        ]
        if doubled:
            raise pytest.UsageError(
                "a test belongs to one stage; these carry two stage markers:\n  "
                + "\n  ".join(doubled)
            )

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, Any, None]:
        outcome = yield
        report: pytest.TestReport = outcome.get_result()
        if stage_of(item):
            return
        seconds = item.stash.get(_SECONDS, 0.0) + report.duration
        item.stash[_SECONDS] = seconds
        if report.when != "teardown" or not report.passed:
            return
        busy = busy_factor()
        limit = FAST_STAGE_LIMIT_S * busy
        if seconds > limit:
            why = f" x{busy:.1f}, the machine being busy" if busy > 1 else ""
            report.outcome = "failed"
            report.longrepr = (
                f"took {seconds:.1f} s, over the fast stage's {limit:.0f} s "
                f"({FAST_STAGE_LIMIT_S:g} s{why}): make it faster, or mark a whole job "
                "@pytest.mark.e2e (README, Testing)"
            )
            report.user_properties.append((_OVER, seconds))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        seconds = float_property(report, _OVER)
        if seconds is not None:
            self.over.append((seconds, report.nodeid))

    @pytest.hookimpl(trylast=True)
    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.over:
            return
        terminalreporter.write_sep(
            "=", f"fast-stage tests over {FAST_STAGE_LIMIT_S:g} s", red=True, bold=True
        )
        for seconds, nodeid in sorted(self.over, reverse=True):
            terminalreporter.write_line(f"{seconds:.1f}s {nodeid}")


def float_property(report: pytest.TestReport, name: str) -> float | None:
    """The number a test's report carries under ``name`` in its ``user_properties`` (set where
    the test ran: under xdist they travel back to the controller with the report)."""
    for key, value in report.user_properties:
        if key == name and isinstance(value, float):
            return value
    return None


_SECONDS = pytest.StashKey[float]()
_OVER = "fast_stage_over_s"
