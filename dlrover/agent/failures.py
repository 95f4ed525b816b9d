"""Turns what the agent saw of failed workers into the policy's observation and a root cause."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dlrover.agent.error_file import ErrorFileError, ErrorRecord, first_failure, read_error_file
from dlrover.agent.failure_policy import (
    TEARDOWN_SIGNALS,
    Decision,
    ExitKind,
    UserErrorSignature,
    WorkerFailure,
    WorkerFailureObservation,
    decide_worker_failure,
    user_error_signature,
)
from dlrover.api.master import FailureClass
from dlrover.constants import CANNOT_START_EXIT_CODE


@dataclass(frozen=True)
class Judgement:
    """The policy's decision about one failed attempt, and the report to print."""

    decision: Decision
    signature: UserErrorSignature | None
    """What to append to the node's failure history."""
    report: str
    exit_code: int
    failure_class: FailureClass = FailureClass.EXIT_CODE
    summary: str = ""
    """One line: each failed worker and how it ended (``rank 1 exit code 1: ValueError: ...``)."""


def classify(failures: Sequence[WorkerFailure]) -> FailureClass:
    """The class of a failed attempt, by its most telling worker: a hang, then an OOM kill,
    then a Python exception (an error file: `COLLATERAL` when every one is a peer's broken
    connection or a collective's timeout and no worker was killed by a signal here), then a
    signal, else a non-zero exit."""
    kinds = {f.kind for f in failures}
    if ExitKind.HUNG in kinds:
        return FailureClass.HANG
    if ExitKind.OOM_KILLED in kinds:
        return FailureClass.OOM
    errors = [f.error for f in failures if f.error is not None]
    if errors:
        killed = any(
            f.kind is ExitKind.SIGNALED and f.returncode not in TEARDOWN_SIGNALS for f in failures
        )
        if all(e.is_collateral() for e in errors):  # the kill here, or a peer elsewhere
            return FailureClass.SIGNAL if killed else FailureClass.COLLATERAL
        return FailureClass.USER_ERROR
    if ExitKind.SIGNALED in kinds:
        return FailureClass.SIGNAL
    return FailureClass.EXIT_CODE


def _read(path: str | None) -> ErrorRecord | None:
    if not path or not os.path.exists(path):
        return None
    try:
        return read_error_file(path)
    except ErrorFileError:
        return None


def judge(
    exits: Mapping[int, int],
    error_files: Mapping[int, str],
    hung: Sequence[int],
    restart_count: int,
    max_restarts: int,
    history: Sequence[UserErrorSignature | None],
    node: str,
    oom_killed: bool = False,
    hang_reasons: Sequence[str] = (),
) -> Judgement:
    """`exits`: global rank -> Popen return code of every failed (or hung) worker;
    ``hang_reasons``: why each hung worker counts as hung (the monitor's lines);
    ``oom_killed``: the node's cgroup counted an OOM kill since the workers started (a worker
    killed by SIGKILL is then taken for OOM-killed)."""
    failures = []
    for rank, code in sorted(exits.items()):
        if rank in hung:
            kind = ExitKind.HUNG
        elif code == -signal.SIGKILL and oom_killed:
            kind = ExitKind.OOM_KILLED
        elif code < 0:
            kind = ExitKind.SIGNALED
        else:
            kind = ExitKind.EXITED
        failures.append(WorkerFailure(rank, kind, code, _read(error_files.get(rank))))
    observation = WorkerFailureObservation(
        tuple(failures), restart_count, max_restarts, tuple(history)
    )
    decision = decide_worker_failure(observation)
    root = first_failure(error_files, {r: (c if c != 0 else 1) for r, c in exits.items()}, node)
    report = root.format() if root is not None else "workers failed"
    if hung:
        why = f": {'; '.join(hang_reasons)}" if hang_reasons else ""
        report = f"ranks {sorted(hung)} hung (stacks dumped to their stderr){why}; {report}"
    code = next((c for c in exits.values() if c > 0), 0)
    if code == 0:
        code = next((128 - c for c in exits.values() if c < 0), 1)
    if decision.cannot_start:
        code = CANNOT_START_EXIT_CODE  # the master does not relaunch the node for it
    return Judgement(
        decision,
        user_error_signature(tuple(failures)),
        report,
        code,
        classify(failures),
        "; ".join(f.describe() for f in failures),
    )
