"""Running a whole job from Python: `JobRunner` (master, engine, controllers) and its records.

The names below are imported on first use: a process that reads only the records (a worker's
fault injection, `dlrover status`) does not import the master with them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dlrover.runner.job_runner import (
        EXIT_FENCED,
        EngineStartError,
        JobAlreadyRunningError,
        JobOutcome,
        JobRunner,
        JobRunnerError,
        JobSettingsError,
        MasterStartError,
        RunnerSettings,
    )

__all__ = [
    "EXIT_FENCED",
    "EngineStartError",
    "JobAlreadyRunningError",
    "JobOutcome",
    "JobRunner",
    "JobRunnerError",
    "JobSettingsError",
    "MasterStartError",
    "RunnerSettings",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("dlrover.runner.job_runner"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
