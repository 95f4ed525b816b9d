"""Running a whole job from Python: `JobRunner` (master, engine, controllers) and its records."""

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
