"""Error files and the bootstrap, exercised in real worker processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlrover.agent.bootstrap import request_stack_dump
from dlrover.agent.error_file import (
    ErrorFileError,
    ErrorRecord,
    first_failure,
    read_error_file,
)

REPO = Path(__file__).resolve().parents[2]


def _run(
    args: list[str],
    tmp_path: Path,
    error_file: Path | None = None,
    rank: int = 0,
    timeout: float = 30,
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), RANK=str(rank))
    if error_file is not None:
        env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
    return subprocess.run(
        args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )


def _script(tmp_path: Path, body: str, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_text(body)
    return path


def test_record_decorator_writes_error_file(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        (
            "from dlrover.agent.error_file import record\n"
            "@record\n"
            "def main():\n"
            "    raise KeyError('missing shard')\n"
            "main()\n"
        ),
    )
    error_file = tmp_path / "attempt_0" / "rank_3" / "error.json"
    before = time.time()
    result = _run([sys.executable, str(script)], tmp_path, error_file, rank=3)
    assert result.returncode == 1
    data = json.loads(error_file.read_text())
    assert set(data) == {
        "message",
        "exception_type",
        "traceback",
        "timestamp",
        "rank",
        "pid",
        "exit_code",
    }
    record = read_error_file(error_file)
    assert record is not None
    assert (record.exception_type, record.message, record.rank, record.exit_code) == (
        "KeyError",
        "'missing shard'",
        3,
        1,
    )
    assert before <= record.timestamp <= time.time()
    assert record.location == f"{script}:4 in main"
    assert record.pid != os.getpid()


def test_clean_exit_and_sys_exit_zero_write_nothing(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        (
            "import sys\nfrom dlrover.agent.error_file import record\n"
            "@record\ndef main():\n    sys.exit(0)\nmain()\n"
        ),
    )
    error_file = tmp_path / "error.json"
    assert _run([sys.executable, str(script)], tmp_path, error_file).returncode == 0
    assert not error_file.exists()


def test_bootstrap_matches_plain_python(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        (
            "import sys, os\n"
            "here = os.path.dirname(os.path.realpath(__file__))\n"
            "print(__name__, sys.argv, sys.path[0] == here)\n"
            "import helper\n"
            "sys.exit(int(sys.argv[1]))\n"
        ),
        name="job.py",
    )
    _script(tmp_path, "", name="helper.py")
    plain = _run([sys.executable, str(script), "7", "--flag"], tmp_path)
    booted = _run(
        [sys.executable, "-m", "dlrover.agent.bootstrap", str(script), "7", "--flag"], tmp_path
    )
    assert (
        (booted.returncode, booted.stdout)
        == (plain.returncode, plain.stdout)
        == (7, f"__main__ {[str(script), '7', '--flag']} True\n")
    )


def test_bootstrap_module_mode_and_error_file(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "run.py").write_text(
        "import sys\nprint(__name__, sys.argv[1:])\nraise ValueError('boom')\n"
    )
    error_file = tmp_path / "error.json"
    plain = _run([sys.executable, "-m", "pkg.run", "a"], tmp_path)
    booted = _run(
        [sys.executable, "-m", "dlrover.agent.bootstrap", "-m", "pkg.run", "a"],
        tmp_path,
        error_file,
    )
    assert booted.returncode == plain.returncode == 1
    assert booted.stdout == plain.stdout == "__main__ ['a']\n"
    assert "ValueError: boom" in booted.stderr
    record = read_error_file(error_file)
    assert record is not None and record.exception_type == "ValueError"
    assert record.location.endswith("pkg/run.py:3 in <module>")


def test_bootstrap_missing_script_is_a_clear_error(tmp_path: Path) -> None:
    result = _run([sys.executable, "-m", "dlrover.agent.bootstrap", "nope.py"], tmp_path)
    assert result.returncode == 2
    assert "can't open file 'nope.py'" in result.stderr


def test_stack_dump_on_signal_keeps_worker_alive(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        (
            "import sys, time\n"
            "def stuck_in_collective():\n"
            "    print('ready', flush=True)\n"
            "    sys.stdin.readline()\n"
            "stuck_in_collective()\n"
            "print('resumed', flush=True)\n"
        ),
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    stderr_path = tmp_path / "stderr"
    with stderr_path.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dlrover.agent.bootstrap", str(script)],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        try:
            assert proc.stdout is not None and proc.stdin is not None
            assert proc.stdout.readline() == "ready\n"
            assert request_stack_dump(proc.pid)
            deadline = time.monotonic() + 10
            while "stuck_in_collective" not in stderr_path.read_text():
                assert time.monotonic() < deadline, "no stack dump within 10 s"
                time.sleep(0.02)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == "resumed\n"
            assert proc.wait(timeout=10) == 0
        finally:
            proc.kill()
            proc.wait(timeout=10)
    # The signal may land on line 3 or 4 of the function, depending on scheduling.
    assert f'File "{script}", line ' in stderr_path.read_text()
    assert "in stuck_in_collective" in stderr_path.read_text()


def test_first_failure_prefers_user_error_then_signal(tmp_path: Path) -> None:
    def write(rank: int, exception_type: str, message: str, timestamp: float) -> Path:
        path = tmp_path / f"rank_{rank}.json"
        trace = f'  File "/t.py", line {rank + 1}, in f\n{exception_type}: {message}\n'
        path.write_text(
            ErrorRecord(message, exception_type, trace, timestamp, rank, 10 + rank, 1).to_json()
        )
        return path

    files = {
        0: write(0, "RuntimeError", "Connection closed by peer", 1.0),
        2: write(2, "ValueError", "late", 9.0),
        3: write(3, "KeyError", "early", 5.0),
    }
    report = first_failure(files, {0: 1, 1: -9, 2: 1, 3: 1, 4: 0}, node="node-1")
    assert report is not None and report.rank == 3
    text = report.format()
    assert text.startswith("root cause: rank 3 on node node-1 ended with exit code 1")
    assert "KeyError: early" in text and "at /t.py:4 in f" in text
    # Without a user error, the SIGKILLed rank explains its peer's lost connection.
    report = first_failure(files, {0: 1, 1: -9})
    assert report is not None and report.rank == 1
    assert "signal SIGKILL (9)" in report.format() and "no error file" in report.format()
    assert first_failure(files, {0: 0, 1: 0}) is None


def test_unreadable_error_file(tmp_path: Path) -> None:
    bad = tmp_path / "error.json"
    bad.write_text("{not json")
    with pytest.raises(ErrorFileError, match="error.json: not JSON"):
        read_error_file(bad)
    assert read_error_file(tmp_path / "absent.json") is None
    report = first_failure({0: bad}, {0: -int(signal.SIGSEGV)})
    assert report is not None and report.error is None
