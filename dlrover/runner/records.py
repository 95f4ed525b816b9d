"""Job records of `dlrover submit`: `$DLROVER_HOME/jobs/<name>/job.json` (how `dlrover status`
and `dlrover stop` find a job's master), `final.json` (what an ended job's status shows) and
`history.json` (its charts on the dashboard)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from dlrover.api.master import FailureClass, FailureRecord, JobStatus, NodeStatus
from dlrover.constants import ENV_HOME


def dlrover_home() -> Path:
    """Where job records live: $DLROVER_HOME, else ~/.dlrover."""
    return Path(os.environ.get(ENV_HOME, "") or Path.home() / ".dlrover")


def job_dir(name: str) -> Path:
    """The job's directory: its record, the master's state, the local engine's logs."""
    return dlrover_home() / "jobs" / name


class NoSuchJobError(Exception):
    """No record of a job by this name."""


@dataclass(frozen=True)
class JobRecord:
    """What the submitter writes when the job starts (with the master's address) and again
    when it ends (with the outcome)."""

    name: str
    state: str
    """running, succeeded or failed."""
    pid: int
    """The submitter's process (it hosts the master)."""
    master_addr: str = ""
    token: str = ""
    engine: str = ""
    reason: str = ""
    exit_code: int = 0
    web_port: int = 0
    """The port of the master's dashboard and /metrics, on the master's host (0: none)."""
    started_at: float = 0.0
    """Unix time the job started serving (0.0: unknown, an older record), and ended."""
    ended_at: float = 0.0

    @property
    def ended(self) -> bool:
        """True once the submitter recorded success or failure."""
        return self.state in ("succeeded", "failed")

    @property
    def reachable(self) -> bool:
        """Whether the record names a master that may still answer."""
        return not self.ended and bool(self.master_addr)


def _path(name: str) -> Path:
    return job_dir(name) / "job.json"


def has_record(name: str) -> bool:
    """Whether a job named ``name`` has a record on this machine."""
    return _path(name).exists()


def write_record(record: JobRecord) -> None:
    """Atomically replace the job's record."""
    path = _path(record.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    doc = {k: v for k, v in asdict(record).items() if v not in ("",)}
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def read_record(name: str) -> JobRecord:
    """The job's record; NoSuchJobError names where it looked."""
    path = _path(name)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise NoSuchJobError(f"no job named {name!r} (looked in {path.parent})") from None
    known = {f.name for f in fields(JobRecord)}
    return JobRecord(**{k: v for k, v in doc.items() if k in known})


def fresh_state(name: str) -> Path:
    """The SQLite state of a new submission of job ``name`` in its directory, with whatever an
    earlier submission left there removed (a new submission starts from a clean state)."""
    directory = job_dir(name)
    directory.mkdir(parents=True, exist_ok=True)
    db = directory / "master.db"
    for stale in (db, db.with_name("master.db-wal"), db.with_name("master.db-shm")):
        stale.unlink(missing_ok=True)
    remove_final(name)
    return db


@dataclass(frozen=True)
class FinalState:
    """What a job's master saw last, written when the job ends: `dlrover status` of an ended job
    prints it (the master that could answer is gone)."""

    status: JobStatus
    """The job and its node table at the end."""
    plans: tuple[tuple[float, str], ...] = ()
    """(unix time, text) of every scale plan acted on, oldest first."""
    failures: tuple[FailureRecord, ...] = ()
    """Every failure recorded, oldest first."""


def _final_path(name: str) -> Path:
    return job_dir(name) / "final.json"


def write_final(name: str, final: FinalState) -> None:
    """Atomically write job ``name``'s final state (before the record says it ended, so a reader
    that sees the end finds it)."""
    path = _final_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = asdict(final)
    for failure in doc["failures"]:
        failure["failure_class"] = failure["failure_class"].value
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def read_final(name: str) -> FinalState | None:
    """Job ``name``'s final state, or None when it left none (it has not ended, ended before
    it served, or was run by an older DLRover)."""
    try:
        doc = json.loads(_final_path(name).read_text())
    except FileNotFoundError:
        return None
    status = dict(doc["status"])
    status["nodes"] = tuple(
        NodeStatus(**{**n, "worker_pids": tuple(n.get("worker_pids", ()))})
        for n in status.get("nodes", ())
    )
    status["embedding_servers"] = ()  # live figures only: an ended job serves no rows
    failures = tuple(
        FailureRecord(**{**f, "failure_class": FailureClass(f["failure_class"])})
        for f in doc.get("failures", ())
    )
    plans = tuple((float(at), str(text)) for at, text in doc.get("plans", ()))
    return FinalState(JobStatus(**status), plans, failures)


def remove_final(name: str) -> None:
    """Forget an earlier submission's final state and history (a new one of the same name
    starts)."""
    _final_path(name).unlink(missing_ok=True)
    _history_path(name).unlink(missing_ok=True)


def _history_path(name: str) -> Path:
    return job_dir(name) / "history.json"


def write_history(name: str, document: dict[str, Any]) -> None:
    """Atomically write job ``name``'s history (`dlrover.master.history.JobHistory.document`)."""
    path = _history_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(document))
    os.replace(tmp, path)


def read_history(name: str) -> dict[str, Any] | None:
    """Job ``name``'s history as its master left it, or None when it left none."""
    try:
        doc = json.loads(_history_path(name).read_text())
    except FileNotFoundError:
        return None
    return doc if isinstance(doc, dict) else None


def job_names() -> list[str]:
    """The jobs with a record in $DLROVER_HOME, by name."""
    root = dlrover_home() / "jobs"
    if not root.is_dir():
        return []
    return sorted(p.parent.name for p in root.glob("*/job.json"))
