"""Runs inside a node's Ray actor: start the node command, report its exit, stop it, and read
its logs back (kept on the actor's machine as the local engine keeps them)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dlrover.checkpoint.leftovers import sweep_configured
from dlrover.constants import ENV_RANK_LOG_DIR
from dlrover.engines.node_logs import RANKS_SUBDIR, LocalNodeLogs

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
        self._node_id = ""
        self._logs: LocalNodeLogs | None = None

    async def start(
        self, command: Sequence[str], env: Mapping[str, str], node_id: str = ""
    ) -> dict[str, object]:
        """Start ``command`` with ``env`` over the actor's environment, in its own session and (on
        Linux) killed when the actor dies; returns the Ray node id, hostname and pid. With a
        ``node_id``, its output and its workers' per-rank logs go to
        ``<$RAY_TMPDIR or the temp dir>/dlrover-nodes/<node_id>/`` on this machine (what
        `read`/`tail` serve)."""
        if self._popen is None:  # a retried start must not run the command twice
            full = {**os.environ, **env}
            out: Any = None
            err: Any = None
            if node_id:
                self._node_id = node_id
                # Next to Ray's own logs: cleaned with its temp dir.
                base = os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()
                self._logs = LocalNodeLogs(Path(base) / "dlrover-nodes")
                node_dir = self._logs.nodes_dir / node_id
                # A started (not adopted) node is new: what an earlier job of the same name left
                # under its id would mix into its logs.
                shutil.rmtree(node_dir, ignore_errors=True)
                node_dir.mkdir(parents=True, exist_ok=True)
                full.setdefault(ENV_RANK_LOG_DIR, str(node_dir / RANKS_SUBDIR))
                out = open(node_dir / "stdout", "ab")  # noqa: SIM115 - the child holds it
                err = open(node_dir / "stderr", "ab")  # noqa: SIM115
            try:
                self._popen = subprocess.Popen(
                    list(command),
                    env=full,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                    preexec_fn=_die_with_parent(),
                )
            finally:
                for f in (out, err):
                    if f is not None:
                        f.close()  # the child has its own descriptors
        return await self.info()

    async def tail(self, rank: int | None, lines: int) -> str | None:
        """`NodeLogs.tail` of this node (None: it keeps no logs)."""
        return self._logs.tail(self._node_id, rank, lines) if self._logs is not None else None

    async def ranks(self) -> list[int]:
        """`NodeLogs.ranks` of this node."""
        return list(self._logs.ranks(self._node_id)) if self._logs is not None else []

    async def read(self, rank: int | None, stream: str, offset: int) -> dict[str, object] | None:
        """`NodeLogs.read` of this node, as a dict of `LogChunk`'s fields."""
        if self._logs is None:
            return None
        chunk = self._logs.read(self._node_id, rank, stream, offset)
        return (
            None
            if chunk is None
            else {"text": chunk.text, "offset": chunk.offset, "source": chunk.source}
        )

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
        code = await asyncio.get_running_loop().run_in_executor(None, popen.wait)
        _sweep_leftovers()
        return code

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
        loop = asyncio.get_running_loop()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(loop.run_in_executor(None, popen.wait), timeout=5.0)
        _sweep_leftovers()


def _sweep_leftovers() -> None:
    """Remove what the ended command's processes left on this machine (shared-memory segments,
    TensorFlow's temp folders): a Ray node's ps or worker always ends killed, and nobody else
    on this machine may run a dlrover process that sweeps. Only dead owners' things go."""
    try:
        sweep_configured()
    except OSError:
        pass  # a best-effort tidy-up must not fail the node's exit report
