"""Runs inside a node's Ray actor: start the node command, report its exit, stop it."""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> Callable[[], None] | None:
    """preexec_fn that makes the kernel SIGKILL the child when the actor process dies, so a lost
    Ray node never leaves the node command running (Linux only; elsewhere None)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return preexec


class NodeRunner:
    """Async Ray actor body. Async so that `stop` can run while `wait` is pending, and so the
    child is forked from the actor's event-loop thread, which lives as long as the actor (the
    parent-death signal fires when the forking thread exits)."""

    def __init__(self) -> None:
        self._popen: subprocess.Popen[bytes] | None = None

    async def start(self, command: Sequence[str], env: Mapping[str, str]) -> dict[str, object]:
        """Start ``command`` with ``env`` over the actor's environment, in its own session and (on
        Linux) killed when the actor dies; returns the Ray node id, hostname and pid."""
        if self._popen is None:  # a retried start must not run the command twice
            self._popen = subprocess.Popen(
                list(command),
                env={**os.environ, **env},
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent(),
            )
        return await self.info()

    async def info(self) -> dict[str, object]:
        """What `start` returned, for an engine that adopts this running node."""
        import ray  # inside the actor: ray is there by construction

        popen = self._popen
        if popen is None:
            raise RuntimeError("info() before start()")
        return {
            "ray_node_id": ray.get_runtime_context().get_node_id(),
            "hostname": socket.gethostname(),
            "pid": popen.pid,
        }

    async def wait(self) -> int:
        """The command's return code (negative: killed by that signal)."""
        popen = self._popen
        if popen is None:
            raise RuntimeError("wait() before start()")
        return await asyncio.get_running_loop().run_in_executor(None, popen.wait)

    async def stop(self, grace_s: float) -> None:
        """SIGTERM the command's process group, SIGKILL it after `grace_s`."""
        popen = self._popen
        if popen is None or popen.poll() is not None:
            return
        try:
            os.killpg(popen.pid, signal.SIGTERM)
            loop = asyncio.get_running_loop()
            await asyncio.wait_for(loop.run_in_executor(None, popen.wait), timeout=grace_s)
        except (ProcessLookupError, asyncio.TimeoutError):
            pass
        try:
            os.killpg(popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
