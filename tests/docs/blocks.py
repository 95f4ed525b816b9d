"""The fenced code blocks of README.md and docs/*.md, and the marker that says who runs each."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO, clean_env

# Blocks a reader could paste into a shell or a Python file; each must be run or marked.
RUNNABLE = frozenset({"bash", "sh", "shell", "console", "python"})
# The line right before a runnable block's fence (see docs/architecture.md, "Docs are tested").
RUN_BY = re.compile(r"^<!-- run by (?P<by>\S+) -->$")
NOT_RUN = re.compile(r"^<!-- not run in CI: (?P<reason>\S.*\S) -->$")
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>```+|~~~+)(?P<info>.*)$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it opens (1-based line of the fence), its info string's first
    word, its text, and the marker line before it ("" without one)."""

    path: Path
    line: int
    language: str
    text: str
    marker: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def doc_files() -> list[Path]:
    """README.md and every docs/*.md: what a user reads and pastes from."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path`` (CommonMark: a closing fence is at least as long as the
    opening one, of the same character)."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence = opening["fence"]
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            closing = FENCE.match(lines[j])
            if (
                closing is not None
                and closing["fence"][0] == fence[0]
                and len(closing["fence"]) >= len(fence)
                and not closing["info"].strip()
            ):
                break
            body.append(lines[j])
            j += 1
        info = opening["info"].strip()
        marker = lines[i - 1].strip() if i > 0 else ""
        found.append(
            Block(path, i + 1, info.split()[0] if info else "", "\n".join(body) + "\n", marker)
        )
        i = j + 1
    return found


# A command in an indented (unfenced) code block: it could hide from the checks, so it is refused.
INDENTED_COMMAND = re.compile(
    r"^ {4,}(\$ |dlrover(-run|-master|-ps)? |python3? |pip |torchrun |export |[A-Z][A-Z_]+=\S* )"
)


def indented_commands(path: Path) -> list[int]:
    """1-based lines of ``path`` outside fences that open an indented code block (after a
    blank line) with a command."""
    lines = path.read_text().splitlines()
    inside = {n for b in blocks(path) for n in range(b.line, b.line + b.text.count("\n") + 2)}
    return [
        i + 1
        for i, line in enumerate(lines)
        if i > 0
        and i + 1 not in inside
        and not lines[i - 1].strip()
        and INDENTED_COMMAND.match(line)
    ]


def all_blocks() -> list[Block]:
    return [b for path in doc_files() for b in blocks(path)]


def doc_block(test: str, index: int = 0) -> Block:
    """The ``index``-th block marked ``<!-- run by tests/docs/<file>::<test> -->`` (the test
    runs the text the reader sees, whatever it becomes)."""
    marked = [b for b in all_blocks() if b.marker == f"<!-- run by {test} -->"]
    assert len(marked) > index, f"no block is marked '<!-- run by {test} -->' (any more)"
    return marked[index]


def marker_id(module_file: str, name: str) -> str:
    """The marker id of test ``name`` in ``module_file`` (a test module's ``__file__``)."""
    return f"{Path(module_file).resolve().relative_to(REPO)}::{name}"


def user_dir(tmp: Path) -> Path:
    """A fresh directory a user would type the docs' commands in: the repository's
    ``examples/`` linked in (the docs name them relative to a checkout), nothing else."""
    where = tmp / "user"
    where.mkdir()
    (where / "examples").symlink_to(REPO / "examples")
    return where


def user_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The test environment for a user's shell: this checkout's dlrover first on the path, job
    records in a fresh $DLROVER_HOME (not the tester's ~/.dlrover)."""
    return clean_env(DLROVER_HOME=str(tmp / "dlrover-home"), **extra)


class Shell:
    """``bash -euo pipefail -c TEXT`` in its own session: what it leaves running in the
    background (a broker, a server started with ``&``) is killed with its process group."""

    def __init__(self, text: str, cwd: Path, env: dict[str, str], log: Path) -> None:
        self.log_path = log
        self._log = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", text],
            cwd=cwd,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"still running after {timeout}s:\n{self.output()[-4000:]}"
            ) from None

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._log.close()


def wait_for(what: str, check: object, timeout: float, interval: float = 0.2) -> object:
    """Call ``check()`` until it returns something true (its value) or ``timeout`` s pass;
    for a state only another process can change (a job record, a file it writes)."""
    assert callable(check)
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout}s for {what}")
        time.sleep(interval)
