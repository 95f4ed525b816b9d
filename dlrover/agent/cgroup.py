"""The node's memory cgroup as the agent reads it: the kernel OOM killer's counter.

A worker killed by SIGKILL may have been killed by the OOM killer or by anything else; the
counter of its memory cgroup tells them apart (cgroup v2 ``memory.events``, v1
``memory.oom_control``: the ``oom_kill`` line). The agent reads it before it starts workers and
again when one dies of SIGKILL.
"""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def memory_cgroup_files(pid: int | None = None, root: Path = CGROUP_ROOT) -> list[Path]:
    """The files that may hold the oom_kill counter of ``pid``'s memory cgroup (default: this
    process), most specific first."""
    try:
        lines = Path(f"/proc/{pid or os.getpid()}/cgroup").read_text().splitlines()
    except OSError:
        return []
    found: list[Path] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        rel = path.lstrip("/")
        if controllers == "":  # v2 unified hierarchy
            found.append(root / rel / "memory.events")
        elif "memory" in controllers.split(","):  # v1 memory controller
            found.append(root / "memory" / rel / "memory.oom_control")
    return found


def oom_kill_count(pid: int | None = None, root: Path = CGROUP_ROOT) -> int | None:
    """How many processes the OOM killer has killed in ``pid``'s memory cgroup; None when no
    cgroup file says (not Linux, no memory controller, not readable)."""
    for path in memory_cgroup_files(pid, root):
        try:
            text = path.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None
