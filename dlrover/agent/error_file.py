"""Per-rank error files: written by a failing worker, read by the agent to name the root cause."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from dlrover import worker_context

ENV_ERROR_FILE = worker_context.ERROR_FILE
"""Path a worker writes its error record to (the name torchrun uses, so tools keep working)."""

TRACEBACK_TAIL_LINES = 12
"""How many traceback lines a failure report shows."""

_FRAME_LINE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')

# Errors that a rank raises because a *peer* died (the collective lost its connection). They are
# never the root cause when another rank died by a signal, and never "the same user error twice".
_COLLATERAL_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError")
_COLLATERAL_MESSAGES = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket timeout",
    "timed out waiting",  # gloo: "Timed out waiting 30000ms for recv operation to complete"
    "connection refused",
    "communicator was aborted",  # NCCL, after a peer's failure aborted the communicator
    "operations have failed or timed out",  # NCCL's watchdog
)

F = TypeVar("F", bound=Callable[..., Any])


class ErrorFileError(Exception):
    """An error file exists but cannot be parsed as a DLRover/torchelastic error record."""


@dataclass(frozen=True)
class ErrorRecord:
    """What one worker wrote when its main raised. Immutable; JSON round-trips exactly."""

    message: str
    exception_type: str
    traceback: str
    timestamp: float
    """Wall-clock seconds (time.time()) when the exception was recorded: comparable across nodes."""
    rank: int
    pid: int
    exit_code: int

    @property
    def location(self) -> str:
        """`file:line in function` of the innermost frame, or '' when the traceback has none."""
        last = ""
        for line in self.traceback.splitlines():
            match = _FRAME_LINE.match(line)
            if match:
                last = f"{match['file']}:{match['line']} in {match['func']}"
        return last

    def traceback_tail(self, lines: int = TRACEBACK_TAIL_LINES) -> str:
        """The last ``lines`` lines of the traceback."""
        return "\n".join(self.traceback.rstrip().splitlines()[-lines:])

    def is_collateral(self) -> bool:
        """True when this error reads like the side effect of a peer's death (lost connection)."""
        short_type = self.exception_type.rsplit(".", 1)[-1]
        if short_type in _COLLATERAL_TYPES:
            return True
        text = self.message.lower()
        return any(pattern in text for pattern in _COLLATERAL_MESSAGES)

    def to_json(self) -> str:
        """The record as JSON (sorted keys); ``from_json`` reads it back exactly."""
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str = "<string>") -> ErrorRecord:
        """Parse a DLRover error record or a torchelastic error file; raises ErrorFileError, naming
        ``source``, for text that is neither."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ErrorFileError(f"{source}: not JSON ({exc}); delete or fix the file") from exc
        if not isinstance(data, dict):
            raise ErrorFileError(f"{source}: expected a JSON object, got {type(data).__name__}")
        # torchelastic's own files nest everything under "message"; accept both shapes.
        if isinstance(data.get("message"), dict):
            data = _from_torchelastic(data["message"])
        try:
            return cls(
                message=str(data["message"]),
                exception_type=str(data.get("exception_type", "")),
                traceback=str(data.get("traceback", "")),
                timestamp=float(data["timestamp"]),
                rank=int(data.get("rank", -1)),
                pid=int(data.get("pid", -1)),
                exit_code=int(data.get("exit_code", 1)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ErrorFileError(
                f"{source}: missing or malformed field {exc}; expected message, timestamp, ..."
            ) from exc


def _from_torchelastic(inner: dict[str, Any]) -> dict[str, Any]:
    extra = inner.get("extraInfo", {}) if isinstance(inner.get("extraInfo"), dict) else {}
    return {
        "message": inner.get("message", ""),
        "exception_type": "",
        "traceback": extra.get("py_callstack", ""),
        "timestamp": float(extra.get("timestamp", 0)),
    }


def record_exception(
    exc: BaseException, path: str | os.PathLike[str], exit_code: int = 1, now: float | None = None
) -> ErrorRecord:
    """Write `exc` as an error record to `path` atomically (temp file + rename) and return it."""
    rank_text = os.environ.get(worker_context.RANK, "-1")
    record = ErrorRecord(
        message=str(exc),
        exception_type=f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins."),
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
        timestamp=time.time() if now is None else now,
        rank=int(rank_text) if rank_text.lstrip("-").isdigit() else -1,
        pid=os.getpid(),
        exit_code=exit_code,
    )
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    temp.write_text(record.to_json())
    os.replace(temp, target)
    return record


class ErrorRecorder:
    """Context manager: if the body raises, write the error record to $TORCHELASTIC_ERROR_FILE.

    The exception is re-raised unchanged, so exit codes stay those of Python. A clean
    `SystemExit(0)` is not an error. When nested (the bootstrap wraps a script that also uses
    `@record`), the innermost writer wins: a file already written by this process is kept.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self._path = path

    def __enter__(self) -> ErrorRecorder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            return
        exit_code = _exit_code_of(exc)
        if exit_code == 0:
            return
        path = self._path if self._path is not None else os.environ.get(ENV_ERROR_FILE)
        if not path or _written_by_this_process(Path(path)):
            return
        try:
            record_exception(exc, path, exit_code)
        except OSError as write_error:
            # Never mask the user's exception with our own.
            print(f"dlrover: cannot write error file {path}: {write_error}", file=sys.stderr)


def _exit_code_of(exc: BaseException) -> int:
    if isinstance(exc, SystemExit):
        if exc.code is None:
            return 0
        return exc.code if isinstance(exc.code, int) else 1
    if isinstance(exc, KeyboardInterrupt):
        return 128 + signal.SIGINT
    return 1


def _written_by_this_process(path: Path) -> bool:
    try:
        existing = read_error_file(path)
    except ErrorFileError:
        return False
    return existing is not None and existing.pid == os.getpid()


def record(fn: F) -> F:
    """Decorator for a worker's main: an escaping exception is written to the error file."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with ErrorRecorder():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def read_error_file(path: str | os.PathLike[str]) -> ErrorRecord | None:
    """The record at `path`; None when no file exists. Raises ErrorFileError when unreadable."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    return ErrorRecord.from_json(text, source=str(path))


def describe_exit(returncode: int) -> str:
    """Popen-style return code as words: 'exit code 3' or 'signal SIGKILL (9)'."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown signal"
        return f"signal {name} ({-returncode})"
    return f"exit code {returncode}"


@dataclass(frozen=True)
class FailureReport:
    """The root cause of one node's failure: which rank, how it ended, and why."""

    rank: int
    node: str
    returncode: int
    error: ErrorRecord | None

    def format(self, tail_lines: int = TRACEBACK_TAIL_LINES) -> str:
        """The root cause in a few lines for the log: rank, node, how it ended, and the error with
        the last ``tail_lines`` lines of its traceback."""
        head = f"root cause: rank {self.rank} on node {self.node or '?'} ended with "
        head += describe_exit(self.returncode)
        if self.error is None:
            return head + " (no error file: killed or crashed outside Python)"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.error.timestamp))
        lines = [
            head,
            f"  {self.error.exception_type}: {self.error.message}",
            f"  at {self.error.location or '?'} ({when} UTC, pid {self.error.pid})",
            self.error.traceback_tail(tail_lines),
        ]
        return "\n".join(lines)


def first_failure(
    error_files: Mapping[int, str | os.PathLike[str]],
    exits: Mapping[int, int],
    node: str = "",
) -> FailureReport | None:
    """Pick the root cause among failed ranks (`exits`: rank -> Popen returncode).

    Order: a user-code error (earliest timestamp first); then a death by signal without an
    error file (a kill or OOM usually explains its peers' lost connections); then errors that
    read like a lost peer; then any other non-zero exit. None when no rank failed.
    Unreadable error files count as missing (their rank is still reported).
    """
    candidates: list[tuple[tuple[int, float, int], FailureReport]] = []
    for rank, returncode in exits.items():
        if returncode == 0:
            continue
        error: ErrorRecord | None = None
        path = error_files.get(rank)
        if path is not None:
            try:
                error = read_error_file(path)
            except ErrorFileError:
                error = None
        if error is not None and not error.is_collateral():
            key = (0, error.timestamp, rank)
        elif error is None and returncode < 0:
            key = (1, 0.0, rank)
        elif error is not None:
            key = (2, error.timestamp, rank)
        else:
            key = (3, 0.0, rank)
        candidates.append((key, FailureReport(rank, node, returncode, error)))
    if not candidates:
        return None
    return min(candidates, key=lambda item: item[0])[1]
