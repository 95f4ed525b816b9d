"""Per-node cgroups for the local engine: a node's `memory` and `cpu` become kernel limits.

A node that asks for resources, or may be resized (``NodeSpec.resizable``), runs in its own
cgroup (unlimited where it asks for nothing), a child of the engine process's own: cgroup v1 ``memory/<self>/dlrover-<node>`` (``memory.limit_in_bytes``, swap
capped the same) and ``cpu/<self>/dlrover-<node>`` (``cpu.cfs_quota_us`` = cpu x
``cpu.cfs_period_us``), or cgroup v2 ``<self>/dlrover-<node>`` (``memory.max``,
``memory.swap.max``, ``cpu.max``). The node's command joins it before it execs, so the agent
and every worker count against the limit, and going over memory is a real OOM kill whose
``oom_kill`` counter the engine reads to tell it from another SIGKILL. Where no cgroup can be
made (no permission, no controller), `CgroupRoot.detect` says why and the engine runs nodes
unlimited. `NodeCgroup.set_limits` changes a running node's limits in place (the engine lowers
memory no further than what the node uses now).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dlrover.engines.base import Resources

CGROUP_ROOT = Path("/sys/fs/cgroup")
PREFIX = "dlrover-"


class CgroupError(Exception):
    """A cgroup cannot be created or configured; the message says which file refused what."""


def _own_paths(root: Path) -> dict[str, str]:
    """controller (``""`` for v2) -> this process's cgroup path."""
    out: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else [""]:
            out[controller] = path.lstrip("/")
    return out


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as e:
        raise CgroupError(f"cannot write {value!r} to {path}: {e.strerror or e}") from None


_V1_UNLIMITED = 1 << 62
"""cgroup v1 reads an unlimited memory limit as a page-rounded 2**63 - 1: anything above this."""


@dataclass
class NodeCgroup:
    """One node's cgroup directories (one per v1 controller, or one v2 directory)."""

    node_id: str
    dirs: list[Path]
    memory_dir: Path | None
    cpu_dir: Path | None = None
    """Where its CPU quota is written (None: no cpu controller here)."""
    v2: bool = False

    def memory_use_bytes(self) -> int:
        """What the node's processes are charged now (anonymous and page cache)."""
        if self.memory_dir is None:
            return 0
        name = "memory.current" if self.v2 else "memory.usage_in_bytes"
        return int((self.memory_dir / name).read_text())

    def memory_limit_bytes(self) -> int | None:
        """The node's memory limit now (None: unlimited)."""
        if self.memory_dir is None:
            return None
        text = (
            self.memory_dir / ("memory.max" if self.v2 else "memory.limit_in_bytes")
        ).read_text()
        if text.strip() == "max" or int(text) >= _V1_UNLIMITED:
            return None
        return int(text)

    def set_limits(self, resources: Resources) -> None:
        """Make the node's memory and CPU limits ``resources`` (0: unlimited) while its
        processes run; raises CgroupError (a limit the kernel refused is left as it was)."""
        mem = self.memory_dir
        if mem is not None:
            new = resources.memory_mib << 20 if resources.memory_mib else None
            if self.v2:
                _write(mem / "memory.max", "max" if new is None else str(new))
                if (mem / "memory.swap.max").exists():
                    _write(mem / "memory.swap.max", "0")
            else:
                value = "-1" if new is None else str(new)
                files = ["memory.limit_in_bytes"]
                if (mem / "memory.memsw.limit_in_bytes").exists():
                    # memory+swap may never be below memory: the bigger one moves first.
                    old = self.memory_limit_bytes()
                    growing = new is None or (old is not None and new >= old)
                    files = [files[0], "memory.memsw.limit_in_bytes"]
                    if growing:
                        files.reverse()
                for name in files:
                    _write(mem / name, value)
        if self.cpu_dir is not None:
            if self.v2:
                quota = f"{int(resources.cpu * 100_000)}" if resources.cpu else "max"
                _write(self.cpu_dir / "cpu.max", f"{quota} 100000")
            elif resources.cpu:
                period = int((self.cpu_dir / "cpu.cfs_period_us").read_text())
                _write(self.cpu_dir / "cpu.cfs_quota_us", str(int(resources.cpu * period)))
            else:
                _write(self.cpu_dir / "cpu.cfs_quota_us", "-1")

    def procs_files(self) -> list[str]:
        """Where a process writes its pid to join (every controller's directory)."""
        return [str(d / "cgroup.procs") for d in self.dirs]

    def oom_kills(self) -> int:
        """Processes the kernel's OOM killer ended in this node (0 when unreadable)."""
        if self.memory_dir is None:
            return 0
        for name in ("memory.events", "memory.oom_control"):
            with contextlib.suppress(OSError):
                for line in (self.memory_dir / name).read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        return 0

    def remove(self, timeout_s: float = 5.0) -> None:
        """Remove the directories once their processes are gone (waits at most
        ``timeout_s``); a leftover is harmless and removed with the next node of that id."""
        deadline = time.monotonic() + timeout_s
        for d in self.dirs:
            _remove_tree(d, deadline)


def _remove_tree(d: Path, deadline: float) -> None:
    """Remove cgroup ``d`` and the cgroups made under it (a slow-fault throttle of a worker
    whose agent was SIGKILLed), killing what still runs in them; gives up at ``deadline``."""
    with contextlib.suppress(OSError):
        for child in [c for c in d.iterdir() if c.is_dir()]:
            _remove_tree(child, deadline)
    with contextlib.suppress(OSError, ValueError):
        for pid in (d / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)  # a worker left in its own session
    while d.exists():
        try:
            d.rmdir()
        except OSError:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)  # the kernel frees an emptied cgroup asynchronously


class CgroupRoot:
    """Where the engine makes its nodes' cgroups."""

    def __init__(self, memory_parent: Path, cpu_parent: Path | None, v2: bool) -> None:
        self._memory_parent = memory_parent
        self._cpu_parent = cpu_parent
        self._v2 = v2

    def describe(self) -> str:
        """For the log: which hierarchy and where."""
        where = [str(self._memory_parent)] + ([str(self._cpu_parent)] if self._cpu_parent else [])
        return f"cgroup {'v2' if self._v2 else 'v1'} under {', '.join(where)}"

    @classmethod
    def detect(cls, root: Path = CGROUP_ROOT) -> tuple[CgroupRoot | None, str]:
        """The root to use, or None and why not."""
        try:
            own = _own_paths(root)
        except OSError as e:
            return None, f"cannot read /proc/self/cgroup ({e})"
        if "memory" in own:  # v1
            memory = root / "memory" / own["memory"]
            cpu = root / "cpu" / own["cpu"] if "cpu" in own else None
            probe = memory / f"{PREFIX}probe-{os.getpid()}"
            try:
                probe.mkdir(exist_ok=True)
                probe.rmdir()
            except OSError as e:
                return None, f"cannot create a memory cgroup under {memory} ({e.strerror or e})"
            if cpu is not None and not os.access(cpu, os.W_OK):
                cpu = None
            return cls(memory, cpu, v2=False), ""
        if "" in own:  # v2 only
            parent = root / own[""]
            controllers = (
                (parent / "cgroup.subtree_control").read_text().split()
                if (parent / "cgroup.subtree_control").exists()
                else []
            )
            if "memory" not in controllers:
                return None, (
                    f"the memory controller is not enabled for children of {parent} "
                    "(cgroup.subtree_control)"
                )
            if not os.access(parent, os.W_OK):
                return None, f"no permission to create cgroups under {parent}"
            return cls(parent, parent if "cpu" in controllers else None, v2=True), ""
        return None, "no memory controller in /proc/self/cgroup"

    def existing(self, node_id: str) -> NodeCgroup | None:
        """The cgroup an earlier engine made for ``node_id``, if it is still there (a restarted
        master adopting the node)."""
        name = f"{PREFIX}{node_id}"
        mem_dir = self._memory_parent / name
        if not mem_dir.is_dir():
            return None
        dirs = [mem_dir]
        cpu_dir = self._cpu_parent / name if self._cpu_parent is not None else None
        if cpu_dir is not None and cpu_dir != mem_dir:
            if cpu_dir.is_dir():
                dirs.append(cpu_dir)
            else:
                cpu_dir = None
        return NodeCgroup(node_id, dirs, mem_dir, cpu_dir, self._v2)

    def create(self, node_id: str, resources: Resources) -> NodeCgroup:
        """A fresh cgroup for ``node_id`` limited to ``resources`` (memory_mib, cpu; 0:
        unlimited, to be limited later with `NodeCgroup.set_limits`); raises CgroupError."""
        name = f"{PREFIX}{node_id}"
        mem_dir = self._memory_parent / name
        dirs = [mem_dir]
        # Made even for an unlimited node: its CPU can be limited in place later.
        cpu_dir = self._cpu_parent / name if self._cpu_parent is not None else None
        if cpu_dir is not None and cpu_dir != mem_dir:
            dirs.append(cpu_dir)
        node = NodeCgroup(node_id, dirs, mem_dir, cpu_dir, self._v2)
        node.remove(timeout_s=1.0)  # a leftover of an earlier node of that id
        for d in dirs:
            try:
                d.mkdir(parents=False, exist_ok=True)
            except OSError as e:
                raise CgroupError(f"cannot create {d}: {e.strerror or e}") from None
        try:
            node.set_limits(resources)
        except (CgroupError, OSError, ValueError):
            node.remove(timeout_s=1.0)
            raise
        return node


_JOIN = 'for f in $DLROVER_CGROUP_PROCS; do echo $$ > "$f" || exit 125; done; exec "$@"'


def cgroup_command(procs_files: list[str], command: Sequence[str]) -> list[str]:
    """``command`` started through a shell that first moves itself into the node's cgroup(s)
    and then execs it (the same pid): no Python runs between fork and exec, which a threaded
    master must not do. Exit 125: the cgroup refused the process."""
    files = " ".join(procs_files)
    return ["/bin/sh", "-c", f"DLROVER_CGROUP_PROCS='{files}'; {_JOIN}", "dlrover-node", *command]


def join_cgroup(procs_files: list[str]) -> None:
    """Move this process into the node's cgroup(s) (tests start helpers with it)."""
    pid = str(os.getpid())
    for path in procs_files:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, pid.encode())
        finally:
            os.close(fd)
