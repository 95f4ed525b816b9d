"""Local engine: each node is a subprocess in its own process group on this machine."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import psutil

from dlrover.constants import (
    DEFAULT_STOP_GRACE_S,
    ENV_NODE_EXIT_FILE,
    ENV_NODE_MEMORY_LIMIT_MIB,
    ENV_RANK_LOG_DIR,
    EXIT_NODE_OOM,
)
from dlrover.engines.base import (
    Capacity,
    Engine,
    EngineError,
    EventQueue,
    FailureReason,
    LaunchError,
    Node,
    NodeEvent,
    NodeNotFoundError,
    NodeSpec,
    NodeState,
    ResizeUnsupportedError,
    Resources,
)
from dlrover.engines.cgroups import CgroupError, CgroupRoot, NodeCgroup, cgroup_command
from dlrover.engines.node_logs import RANKS_SUBDIR, LocalNodeLogs

log = logging.getLogger(__name__)

_KILL_WAIT_S = 5.0
"""How long a SIGKILLed process may take to disappear before we log it as stuck."""


@dataclasses.dataclass
class _Process:
    node: Node
    pid: int
    popen: subprocess.Popen[bytes] | None
    """None for a node adopted from an earlier engine (not our child: watched through psutil)."""
    deleting: bool = False
    finished: threading.Event = dataclasses.field(default_factory=threading.Event)
    cgroup: NodeCgroup | None = None
    """The node's own cgroup when its resources are enforced."""


def _create_time(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def stop_process_group(pgid: int, grace_s: float, leader: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM the whole group, wait up to `grace_s` for the leader, then SIGKILL the group.

    The group is SIGKILLed even when the leader exited in time, so children it left behind
    (an agent's workers) never outlive their node.
    """
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if leader is not None:
        try:
            leader.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            log.warning(
                "process group %d ignored SIGTERM for %.1fs; sending SIGKILL", pgid, grace_s
            )
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if leader is not None:
        try:
            leader.wait(timeout=_KILL_WAIT_S)
        except subprocess.TimeoutExpired:
            log.error(
                "process %d survived SIGKILL for %.0fs (stuck in the kernel?)",
                leader.pid,
                _KILL_WAIT_S,
            )


class LocalEngine(Engine):
    """Nodes are subprocesses started with `spec.command` and `os.environ | spec.env`.

    Each runs in its own session (process group), so delete and close reach the agent and every
    worker it spawned: SIGTERM, `stop_grace_s`, SIGKILL. A node whose leader process exits is
    reported (exit code 0 -> SUCCEEDED, else FAILED with EXIT_CODE or SIGNAL), and whatever it
    left running in its group is killed. stdout/stderr go to `<log_dir>/<node_id>/`.
    With ``enforce_resources`` (and a cgroup hierarchy this process may write), a node that asks
    for resources, or is ``resizable``, runs in its own cgroup, limited to its resources
    (unlimited where it asks for none), so `resize` can change its limits while it runs.

    Nodes outlive the engine's process (their own sessions): each node's pid and start time are
    kept in `<log_dir>/<node_id>/pid`, so an engine of a restarted master that launches the same
    node id adopts the running process instead of starting a second one. An adopted node is not
    our child: its end is seen through psutil and its exit code read from the file dlrover-run
    writes as it ends ($DLROVER_NODE_EXIT_FILE); without one it is reported lost.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        stop_grace_s: float = DEFAULT_STOP_GRACE_S,
        enforce_resources: bool = True,
        capacity: Capacity | None = None,
    ) -> None:
        self._log_dir = Path(log_dir)
        self._capacity = capacity or Capacity()
        self._stop_grace_s = stop_grace_s
        self._enforce = enforce_resources
        self._cgroups: CgroupRoot | None = None
        self._cgroups_checked = False
        self._processes: dict[str, _Process] = {}
        self._queue = EventQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._host = socket.gethostname()

    def launch(self, spec: NodeSpec) -> Node:
        """Start the node's command in a new session, its output appended to
        ``<log_dir>/<node_id>/{stdout,stderr}``; returns the node RUNNING (an existing id returns
        that node). Raises EngineError once closed, LaunchError if the command cannot start."""
        with self._lock:
            if self._closed:
                raise EngineError("the local engine is closed")
            existing = self._processes.get(spec.node_id)
            if existing is not None:
                return dataclasses.replace(existing.node)
            node_dir = self._log_dir / spec.node_id
            node_dir.mkdir(parents=True, exist_ok=True)
            adopted = self._adopt(spec, node_dir)
            if adopted is not None:
                return adopted
            (node_dir / "exit_code").unlink(missing_ok=True)
            # Per-rank logs of an earlier job of this name: the new agent's attempts count from
            # 0 again and would mix with them.
            shutil.rmtree(node_dir / RANKS_SUBDIR, ignore_errors=True)
            env = {
                **os.environ,
                ENV_RANK_LOG_DIR: str(node_dir / RANKS_SUBDIR),  # `dlrover logs --rank` reads them
                **spec.env,
                ENV_NODE_EXIT_FILE: str(node_dir / "exit_code"),
            }
            cgroup = self._cgroup_for(spec)
            if cgroup is not None and shutil.which(spec.command[0], path=env.get("PATH")) is None:
                # The shell that joins the cgroup would start and fail with 127: say it here.
                cgroup.remove(timeout_s=1.0)
                raise LaunchError(
                    f"{spec.node_id}: cannot start {spec.command[0]!r}: no such executable"
                )
            if cgroup is not None and spec.resources.memory_mib:
                env[ENV_NODE_MEMORY_LIMIT_MIB] = str(spec.resources.memory_mib)
            try:
                with open(node_dir / "stdout", "ab") as out, open(node_dir / "stderr", "ab") as err:
                    popen = subprocess.Popen(
                        cgroup_command(cgroup.procs_files(), spec.command)
                        if cgroup is not None
                        else list(spec.command),
                        env=env,
                        stdout=out,
                        stderr=err,
                        stdin=subprocess.DEVNULL,
                        start_new_session=True,
                    )
            except (OSError, subprocess.SubprocessError) as error:
                if cgroup is not None:
                    cgroup.remove(timeout_s=1.0)
                raise LaunchError(
                    f"{spec.node_id}: cannot start {spec.command[0]!r}: {error}"
                ) from error
            node = Node(spec=spec, state=NodeState.RUNNING, host=self._host)
            process = _Process(node=node, pid=popen.pid, popen=popen, cgroup=cgroup)
            self._processes[spec.node_id] = process
            started = _create_time(popen.pid)
            (node_dir / "pid").write_text(f"{popen.pid} {started}\n")
        log.info("node %s: started pid %d: %s", spec.node_id, popen.pid, " ".join(spec.command))
        self._queue.put(
            NodeEvent(
                spec.node_id, spec, NodeState.RUNNING, host=self._host, message=f"pid {popen.pid}"
            )
        )
        threading.Thread(
            target=self._watch, args=(process,), name=f"watch-{spec.node_id}", daemon=True
        ).start()
        return dataclasses.replace(node)

    def _cgroup_for(self, spec: NodeSpec) -> NodeCgroup | None:
        """The node's cgroup limited to its resources (unlimited where it asks for none), or
        None (not enforcing, or no cgroup can be made here: said once, and nodes run unlimited).
        Called under the lock."""
        resources = spec.resources
        if not self._enforce or not (resources.memory_mib or resources.cpu or spec.resizable):
            return None
        if not self._cgroups_checked:
            self._cgroups_checked = True
            self._cgroups, why = CgroupRoot.detect()
            if self._cgroups is None:
                log.warning("node resources are not enforced (nodes run unlimited): %s", why)
            else:
                log.info("node resources are enforced: %s", self._cgroups.describe())
        if self._cgroups is None:
            return None
        try:
            return self._cgroups.create(spec.node_id, resources)
        except CgroupError as e:
            if resources.memory_mib or resources.cpu:
                log.warning("node %s runs unlimited: %s", spec.node_id, e)
            return None

    def _adopted_cgroup(self, spec: NodeSpec) -> NodeCgroup | None:
        """The cgroup an earlier engine made for an adopted node (watched and removed by this
        one), or None."""
        wanted = spec.resources.memory_mib or spec.resources.cpu or spec.resizable
        if not self._enforce or not wanted:
            return None
        if not self._cgroups_checked:
            self._cgroups_checked = True
            self._cgroups, _ = CgroupRoot.detect()
        return self._cgroups.existing(spec.node_id) if self._cgroups is not None else None

    def _adopt(self, spec: NodeSpec, node_dir: Path) -> Node | None:
        """The node of ``spec`` if an earlier engine started it and it still runs (same pid and
        start time), now watched by this engine; else None. Called under the lock."""
        try:
            pid_text, started_text = (node_dir / "pid").read_text().split()
            pid, started = int(pid_text), float(started_text)
        except (OSError, ValueError):
            return None
        if _create_time(pid) != started:
            return None  # gone, or the pid now names another process
        node = Node(spec=spec, state=NodeState.RUNNING, host=self._host)
        process = _Process(node=node, pid=pid, popen=None, cgroup=self._adopted_cgroup(spec))
        self._processes[spec.node_id] = process
        log.info(
            "node %s: adopted the running pid %d (started by an earlier master)", spec.node_id, pid
        )
        threading.Thread(
            target=self._watch, args=(process,), name=f"watch-{spec.node_id}", daemon=True
        ).start()
        return dataclasses.replace(node)

    def _wait_exit(self, process: _Process) -> int | None:
        """Block until the node's leader exits; its exit code (None if it cannot be known)."""
        if process.popen is not None:
            return process.popen.wait()
        try:
            leader = psutil.Process(process.pid)
            while True:
                try:
                    leader.wait(timeout=0.5)
                    break
                except psutil.TimeoutExpired:
                    # Not our child: once it exits it stays a zombie until its new parent
                    # reaps it, which need not be soon.
                    if leader.status() == psutil.STATUS_ZOMBIE:
                        break
        except psutil.Error:
            pass  # gone
        exit_file = self._log_dir / process.node.spec.node_id / "exit_code"
        try:
            return int(exit_file.read_text().strip())
        except (OSError, ValueError):
            return None

    @staticmethod
    def _oom_killed(process: _Process, returncode: int) -> bool:
        """The node died of memory: its cgroup counted an OOM kill and the node ended with
        EXIT_NODE_OOM (its agent left after a worker's OOM kill) or by SIGKILL (the agent itself
        was the OOM killer's pick). A script that exits 6 without an OOM is not taken for one,
        nor a node without a memory limit (the machine ran out, not the node: no size to grow)."""
        return (
            returncode in (EXIT_NODE_OOM, -signal.SIGKILL)
            and process.node.spec.resources.memory_mib > 0
            and process.cgroup is not None
            and process.cgroup.oom_kills() > 0
        )

    def _watch(self, process: _Process) -> None:
        # The wait ends when the process exits; delete/close bound that by SIGKILL.
        returncode = self._wait_exit(process)
        with self._lock:
            deleting = process.deleting
            handed_over = self._closed and not deleting
        if handed_over:
            # Closed with its nodes left running: the engine of a restarted master adopts and
            # watches them. Reaping or removing the node's cgroup here would race that engine,
            # which may already have started a fresh node of that id in a new cgroup of the
            # same name.
            return
        # Reap what the leader left behind in its group before reporting the node as ended.
        stop_process_group(process.pid, self._stop_grace_s, None)
        spec = process.node.spec
        if deleting:
            event = NodeEvent(
                spec.node_id, spec, NodeState.DELETED, host=self._host, message="deleted on request"
            )
        elif returncode is None:
            event = NodeEvent(
                spec.node_id,
                spec,
                NodeState.FAILED,
                FailureReason.NODE_LOST,
                host=self._host,
                message="an adopted node ended without an exit record",
            )
        elif self._oom_killed(process, returncode):
            event = NodeEvent(
                spec.node_id,
                spec,
                NodeState.FAILED,
                FailureReason.OOM_KILLED,
                exit_code=returncode if returncode > 0 else None,
                signal=-returncode if returncode < 0 else None,
                host=self._host,
                message=f"OOM-killed at its {spec.resources.memory_mib} MiB memory limit",
            )
        elif returncode == 0:
            event = NodeEvent(spec.node_id, spec, NodeState.SUCCEEDED, exit_code=0, host=self._host)
        elif returncode < 0:
            sig = -returncode
            event = NodeEvent(
                spec.node_id,
                spec,
                NodeState.FAILED,
                FailureReason.SIGNAL,
                signal=sig,
                host=self._host,
                message=f"killed by {signal.Signals(sig).name}",
            )
        else:
            event = NodeEvent(
                spec.node_id,
                spec,
                NodeState.FAILED,
                FailureReason.EXIT_CODE,
                exit_code=returncode,
                host=self._host,
                message=f"exited with code {returncode}",
            )
        with self._lock:
            process.node.state = event.state
        log.info("node %s: running -> %s", spec.node_id, event.outcome())
        if process.cgroup is not None:
            process.cgroup.remove()
        self._queue.put(event)
        process.finished.set()

    def pid(self, node_id: str) -> int:
        """The node's leader pid (what a fault-injection test kills)."""
        with self._lock:
            process = self._processes.get(node_id)
        if process is None:
            raise NodeNotFoundError(node_id)
        return process.pid

    def resize(self, node_id: str, resources: Resources) -> Node:
        """Change the running node's cgroup limits to ``resources`` without restarting anything;
        returns the node with its new spec. Raises NodeNotFoundError, or ResizeUnsupportedError
        where it cannot be done in place (the node ended, runs without a cgroup, or would be
        limited below the memory it uses now): relaunch it instead."""
        with self._lock:
            process = self._processes.get(node_id)
            if process is None:
                raise NodeNotFoundError(node_id)
            if process.node.state.is_final:
                raise ResizeUnsupportedError(f"node {node_id} ended ({process.node.state.value})")
            cgroup = process.cgroup
            if cgroup is None:
                raise ResizeUnsupportedError(
                    f"node {node_id} runs without a cgroup of its own (launched without "
                    "resources and not resizable, resources not enforced, or no cgroup could be "
                    "made): its limits cannot change in place"
                )
            old = process.node.spec.resources
            try:
                used = cgroup.memory_use_bytes()
                if resources.memory_mib and resources.memory_mib << 20 < used:
                    raise ResizeUnsupportedError(
                        f"node {node_id} uses {used >> 20} MiB now: a {resources.memory_mib} MiB "
                        "limit would be below it"
                    )
                cgroup.set_limits(resources)
            except (CgroupError, OSError, ValueError) as e:
                raise ResizeUnsupportedError(f"node {node_id}: {e}") from None
            process.node.spec = dataclasses.replace(process.node.spec, resources=resources)
            node = dataclasses.replace(process.node)
        log.info(
            "node %s: resized in place (pid %d): %d -> %d MiB, %g -> %g CPU",
            node_id,
            process.pid,
            old.memory_mib,
            resources.memory_mib,
            old.cpu,
            resources.cpu,
        )
        return node

    def delete(self, node_id: str) -> None:
        """SIGTERM the node's process group, SIGKILL it after ``stop_grace_s``, and return once its
        DELETED event is queued; nothing for a node that already ended. Raises NodeNotFoundError, or
        EngineError if the process outlives SIGKILL."""
        with self._lock:
            process = self._processes.get(node_id)
            if process is None:
                raise NodeNotFoundError(node_id)
            if process.node.state.is_final:
                return
            process.deleting = True
        stop_process_group(process.pid, self._stop_grace_s, process.popen)
        # Wait for the watcher so the DELETED event is queued when delete returns.
        if not process.finished.wait(timeout=self._stop_grace_s + 5):
            raise EngineError(f"node {node_id}: process {process.pid} did not end after SIGKILL")

    def logs(self) -> LocalNodeLogs:
        """The nodes' logs in ``<log_dir>``: each agent's stderr, its workers' per-rank logs."""
        return LocalNodeLogs(self._log_dir)

    def capacity(self) -> Capacity:
        """The configured capacity (``--capacity``) less what the live nodes ask for; unknown
        where none was configured."""
        with self._lock:
            live = [
                p.node.spec.resources for p in self._processes.values() if not p.node.state.is_final
            ]
        cap = self._capacity
        return Capacity(
            None if cap.cpu is None else cap.cpu - sum(r.cpu for r in live),
            None if cap.memory_mib is None else cap.memory_mib - sum(r.memory_mib for r in live),
        )

    def list_nodes(self) -> list[Node]:
        """Copies of every node launched, with their current states."""
        with self._lock:
            return [dataclasses.replace(p.node) for p in self._processes.values()]

    def events(self, timeout: float) -> list[NodeEvent]:
        """Queued node events, waiting up to ``timeout`` seconds for the first."""
        return self._queue.drain(timeout)

    def close(self, delete_nodes: bool = True) -> None:
        """Refuse new launches; with ``delete_nodes``, SIGTERM every running node's group at once,
        wait one ``stop_grace_s`` for all of them, then SIGKILL the ones left."""
        with self._lock:
            self._closed = True
            running = [p for p in self._processes.values() if not p.node.state.is_final]
            if delete_nodes:
                for process in running:
                    process.deleting = True
        if not delete_nodes:
            return
        # Signal every group first, then wait once: closing N nodes costs one grace, not N.
        for process in running:
            try:
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self._stop_grace_s
        for process in running:
            process.finished.wait(timeout=max(0.0, deadline - time.monotonic()))
        for process in running:
            if not process.finished.is_set():
                stop_process_group(process.pid, 0.0, process.popen)
                process.finished.wait(timeout=5)
