"""Start workers in tests and benchmarks: from a zygote or with Popen, behind one handle type.

The agent does not use this module: it starts its workers in ``dlrover.agent.workers``. These
helpers drive `dlrover.agent.zygote` directly, so a test can compare a forked worker with a
freshly started one, or wait for the first of several workers to exit.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence

from dlrover.agent.bootstrap import ENV_PARENT_DEATH_PID
from dlrover.agent.zygote import (
    DEFAULT_PRELOAD,
    PopenWorker,
    WorkerHandle,
    Zygote,
    ZygoteError,
    with_package_on_path,
)

log = logging.getLogger(__name__)


def wait_any(handles: Sequence[WorkerHandle], timeout: float) -> list[WorkerHandle]:
    """Block until at least one handle has exited or `timeout` passes; the exited handles."""
    woken = threading.Event()

    def wake(_handle: WorkerHandle) -> None:
        woken.set()

    for handle in handles:
        handle.add_exit_callback(wake)
    try:
        woken.wait(timeout)
    finally:
        # A monitor loop calls this many times: leave no callbacks behind.
        for handle in handles:
            handle.remove_exit_callback(wake)
    return [handle for handle in handles if handle.poll() is not None]


def spawn_popen(
    argv: Sequence[str],
    env: Mapping[str, str],
    cwd: str | os.PathLike[str],
    stdout_path: str | os.PathLike[str],
    stderr_path: str | os.PathLike[str],
) -> PopenWorker:
    """Start `python -m dlrover.agent.bootstrap *argv` in its own session: a fresh interpreter
    with the set-up of a forked worker (error file, stack dumps, death with this process)."""
    child_env = dict(env)
    child_env[ENV_PARENT_DEATH_PID] = str(os.getpid())
    with open(stdout_path, "ab") as stdout, open(stderr_path, "ab") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "dlrover.agent.bootstrap", *argv],
            env=with_package_on_path(child_env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
    return PopenWorker(process)


class WorkerLauncher:
    """Starts workers from a zygote when one is available, else with Popen (same handles)."""

    def __init__(
        self,
        use_zygote: bool = True,
        preload: Sequence[str] = DEFAULT_PRELOAD,
        start_timeout: float = 60.0,
    ) -> None:
        self._zygote: Zygote | None = None
        self._lock = threading.Lock()
        if use_zygote:
            started = time.monotonic()
            try:
                self._zygote = Zygote.start(preload, start_timeout)
            except (ZygoteError, OSError) as exc:
                log.warning("zygote unavailable (%s); workers start with Popen", exc)
            else:
                log.info("zygote started in %.2f s", time.monotonic() - started)

    @property
    def zygote(self) -> Zygote | None:
        """The zygote once it started, else None (spawns fall back to Popen)."""
        return self._zygote

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str | os.PathLike[str],
        stdout_path: str | os.PathLike[str],
        stderr_path: str | os.PathLike[str],
    ) -> WorkerHandle:
        """Fork the worker from the zygote, or start it with Popen if the zygote is not there."""
        with self._lock:
            zygote = self._zygote
        if zygote is not None and zygote.alive:
            try:
                return zygote.spawn(argv, env, cwd, stdout_path, stderr_path)
            except ZygoteError as exc:
                log.warning("zygote spawn failed (%s); falling back to Popen", exc)
        return spawn_popen(argv, env, cwd, stdout_path, stderr_path)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the zygote (its forked workers are the caller's to stop)."""
        with self._lock:
            zygote, self._zygote = self._zygote, None
        if zygote is not None:
            zygote.close(timeout)
