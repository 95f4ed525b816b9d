"""`benchmarks/recovery_goodput.py`'s goodput by work: the time of a steady step leaves out
the steps that may hold a compile (a process's first, the first after a kill or after the
process group was made again) and a shrunk world's steps, so a launcher whose restarted step compiles for seconds is not credited with them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _bench() -> Any:
    sys.path.insert(0, str(BENCHMARKS))  # it imports its sibling modules by name
    try:
        spec = importlib.util.spec_from_file_location(
            "recovery_goodput", BENCHMARKS / "recovery_goodput.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules.setdefault("recovery_goodput", module)  # its dataclasses look it up
        spec.loader.exec_module(sys.modules["recovery_goodput"])
        return sys.modules["recovery_goodput"]
    finally:
        sys.path.remove(str(BENCHMARKS))


def _steps(*rows: tuple[int, float, float, int, int]) -> list[dict[str, float]]:
    return [
        {"step": step, "began": began, "ended": began + took, "pid": pid, "world": world}
        for step, began, took, pid, world in rows
    ]


def test_compiling_and_shrunk_steps_are_not_steady() -> None:
    steady_step_s = _bench().steady_step_s
    steps = _steps(
        (1, 0.0, 0.5, 100, 2),  # the first process's first step: it compiles
        (2, 0.5, 0.2, 100, 2),
        (3, 0.7, 0.2, 100, 2),
        (4, 9.0, 0.4, 100, 1),  # a shrunk world's step: two ranks' data
        (5, 9.4, 0.5, 100, 2),  # the first begun after the world grew back (group made at 9.35)
        (6, 9.9, 0.2, 100, 2),
        (7, 20.0, 0.5, 200, 2),  # a restarted process's first step
        (8, 20.5, 0.2, 200, 2),
    )
    assert abs(steady_step_s(steps, [8.5, 9.35]) - 0.2) < 1e-9  # steps 2, 3, 6 and 8
    assert steady_step_s(steps[:1], []) is None


def test_a_step_far_slower_than_the_rest_is_not_steady() -> None:
    steady_step_s = _bench().steady_step_s
    steps = _steps(*((i, 0.1 * i, 0.1, 7, 2) for i in range(1, 11)), (11, 2.0, 4.0, 7, 2))
    assert abs(steady_step_s(steps, []) - 0.1) < 1e-9


def test_a_failure_free_run_by_work_is_its_time_in_steps() -> None:
    steady_step_s = _bench().steady_step_s
    steps = _steps(*((i, 0.1 * i, 0.1, 7, 2) for i in range(1, 101)))
    assert abs(steady_step_s(steps, []) - 0.1) < 1e-9
