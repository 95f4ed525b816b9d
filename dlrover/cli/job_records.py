"""Job records of `dlrover submit`; they live in `dlrover.runner.records` (kept importable here)."""

from dlrover.processes import pid_alive
from dlrover.runner.records import (
    JobRecord,
    NoSuchJobError,
    dlrover_home,
    has_record,
    job_dir,
    read_record,
    write_record,
)

__all__ = [
    "JobRecord",
    "NoSuchJobError",
    "dlrover_home",
    "has_record",
    "job_dir",
    "pid_alive",
    "read_record",
    "write_record",
]
