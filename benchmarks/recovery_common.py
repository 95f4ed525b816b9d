"""Shared pieces of the recovery benchmarks: launching a job, stamping its log, reading its files."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parent.parent
TRAIN = str(Path(__file__).resolve().with_name("recovery_train.py"))


class BenchmarkError(RuntimeError):
    """A benchmark run could not be set up or measured (not: a launcher failed to recover)."""


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DLROVER_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(REPO)
    env["DLROVER_LOG_LEVEL"] = "INFO"
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    env.update(extra)
    return env


def dlrover_run_cmd(*flags: str) -> list[str]:
    return [sys.executable, "-m", "dlrover.cli.run", *flags]


def torchrun_cmd(*flags: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *flags]


def master_cmd(env_file: str | Path, state_db: str | Path, *flags: str) -> list[str]:
    """A standalone `dlrover-master` on a free port that writes its address and token to
    ``env_file``, its state in ``state_db``: in the benchmark's own folder, so that a master
    killed at the end leaves no scratch state behind."""
    return [
        sys.executable,
        "-m",
        "dlrover.cli.master",
        "--port",
        "0",
        "--write-env",
        str(env_file),
        "--state-db",
        str(state_db),
        *flags,
    ]


@dataclass
class Job:
    """One launcher process (its own session) with every output line stamped on arrival.

    The agent's log format has whole seconds only; its records are flushed line by line to the
    pipe, so the arrival time here is the emission time within a millisecond or so."""

    popen: subprocess.Popen[bytes]
    out: Path
    lines: list[tuple[float, str]] = field(default_factory=list)
    reader: threading.Thread | None = None

    @classmethod
    def start(cls, cmd: Sequence[str], out: Path, env: dict[str, str], cwd: Path = REPO) -> Job:
        out.mkdir(parents=True, exist_ok=True)
        popen = subprocess.Popen(
            list(cmd),
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        job = cls(popen, out)
        job.reader = threading.Thread(target=job._read, daemon=True)
        job.reader.start()
        return job

    def _read(self) -> None:
        assert self.popen.stdout is not None
        with open(self.out / "launcher.log", "w") as log:
            for raw in self.popen.stdout:
                now = time.time()
                line = raw.decode(errors="replace").rstrip("\n")
                self.lines.append((now, line))
                log.write(f"{now:.3f} {line}\n")

    def first_line(self, needle: str, after: float) -> float | None:
        for at, line in list(self.lines):
            if at >= after and needle in line:
                return at
        return None

    def steps(self) -> list[dict[str, float]]:
        return read_jsonl(self.out / "steps.jsonl")

    def procs(self) -> list[dict[str, float]]:
        return read_jsonl(self.out / "proc.jsonl")

    def pid_of(self, rank: int) -> tuple[int, int]:
        """(worker pid, agent pid or 0) last written by rank `rank`."""
        try:
            fields = (self.out / f"pid.{rank}").read_text().split()
        except FileNotFoundError:
            return 0, 0
        return int(fields[0]), int(fields[1]) if len(fields) > 1 else 0

    def finish(self, timeout: float = 20.0) -> int | None:
        """End the run: every rank stops a few steps ahead; force it if that does not work."""
        last = max((int(s["step"]) for s in self.steps()), default=0)
        (self.out / "stop_at").write_text(str(last + 5))
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        self.kill()
        return None

    def kill(self) -> None:
        """Force the launcher, its session and every worker it recorded down (by pid)."""
        pids = {int(p["pid"]) for p in self.procs()}
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(10.0 if sig == signal.SIGTERM else 5.0)
                break
            except subprocess.TimeoutExpired:
                continue
        for pid in pids:  # dlrover workers live in sessions of their own
            try:
                proc = psutil.Process(pid)
                if any("recovery_train" in part for part in proc.cmdline()):
                    proc.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass


def read_jsonl(path: Path) -> list[dict[str, float]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines():
        if line.endswith("}"):  # a line being written right now is skipped
            rows.append(json.loads(line))
    return rows


def wait_for(what: Callable[[], object], timeout: float, interval: float = 0.01) -> object:
    """The first truthy value of `what()` within `timeout`, else None."""
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if value:
            return value
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)


def zygote_idle(job: Job, count: int = 1, quiet_s: float = 1.0) -> bool:
    """True once `count` zygotes under the launcher exist and none used CPU for `quiet_s` (the
    preload is done and they wait for requests; the agent logs 'ready' only when it asks)."""
    try:
        children = psutil.Process(job.popen.pid).children(recursive=True)
        forked = {c.pid for c in children if any("zygote_server" in x for x in c.cmdline())}
        # Workers forked from a zygote carry its command line: a zygote is one whose parent
        # is not a zygote (the agent started it).
        zygotes = [c for c in children if c.pid in forked and c.ppid() not in forked]
        if len(zygotes) < count:
            return False
        before = [sum(z.cpu_times()[:2]) for z in zygotes]
        time.sleep(quiet_s)
        return [sum(z.cpu_times()[:2]) for z in zygotes] == before
    except psutil.NoSuchProcess:
        return False


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
