"""Names of what an agent leaves on its node (segments, temp folder), its owner lock, and the sweep of dead owners' leftovers."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass

from dlrover.checkpoint.config import DEFAULT_SHM_DIR, shm_dirs_from_env
from dlrover.processes import pid_alive

log = logging.getLogger(__name__)

NAME_PREFIX = "dlrover."
"""Every name below starts with it: ``dlrover.<job>.<node>.<pid>[.<what>]``."""
LOCK_SUFFIX = ".lock"
MAX_LABEL = 24
"""Job names and node ids are cut to this many characters (segment names stay < 255 bytes)."""

_LABEL_BAD = re.compile(r"[^A-Za-z0-9_-]")
_OWNED = re.compile(
    r"^dlrover\.(?P<job>[A-Za-z0-9_-]+)\.(?P<node>[A-Za-z0-9_-]+)\.(?P<pid>\d+)(?:\.(?P<what>.+))?$"
)
# Names of releases before the owner was named (``dlrover-<pid>-ckpt-...`` of an agent,
# ``dlrover-ckpt-<pid>-<tag>-...`` of an in-process saver): only the pid tells the owner.
_LEGACY = re.compile(r"^dlrover-(?:ckpt-)?(?P<pid>\d+)-")
LEGACY_TMP_PREFIX = "dlrover_agent_"
"""Temp folders of agents before the owner was named: nothing in the name tells the owner."""
LEGACY_TMP_IDLE_S = 24 * 3600.0
"""Such a folder is removed once nothing in it changed for this long (a live agent's workers
write their step files into it every step)."""


def label(text: str) -> str:
    """``text`` as one component of a name: letters, digits, _ and - only, at most MAX_LABEL."""
    return _LABEL_BAD.sub("_", text)[:MAX_LABEL] or "_"


_SOCKET_PATH_MAX = 107
"""A unix socket's path holds 108 bytes with its terminating NUL (Linux)."""


def runtime_dir() -> str:
    """Where a process keeps its sockets and temp folders: the temp folder (TMPDIR), or /tmp
    where the temp folder's path leaves no room for a socket under an owner-named folder (a
    deep TMPDIR made ``bind`` fail with 'AF_UNIX path too long')."""
    tmp = tempfile.gettempdir()
    longest = len(NAME_PREFIX) + 2 * MAX_LABEL + 32  # prefix, job, node, pid, a socket's name
    if len(tmp) + 1 + longest <= _SOCKET_PATH_MAX or not os.access("/tmp", os.W_OK | os.X_OK):
        return tmp
    return "/tmp"


def owner_prefix(job: str, node: str, pid: int) -> str:
    """``dlrover.<job>.<node>.<pid>``: what every segment, lock and temp folder of the process
    ``pid`` (an agent, or a trainer's in-process saver) serving ``node`` of ``job`` starts with."""
    return f"{NAME_PREFIX}{label(job)}.{label(node)}.{pid}"


@dataclass(frozen=True)
class Owned:
    """A name of the form ``owner_prefix(...)[.<what>]``, parsed."""

    prefix: str
    job: str
    node: str
    pid: int


def parse(name: str) -> Owned | None:
    """The owner of ``name`` if it is one of ours (see ``owner_prefix``), else None."""
    match = _OWNED.match(name)
    if match is None:
        return None
    what = match.group("what")
    prefix = name if what is None else name[: -len(what) - 1]
    return Owned(prefix, match.group("job"), match.group("node"), int(match.group("pid")))


class OwnerLock:
    """``<shm_dir>/<prefix>.lock``, flocked for the life of the owning process.

    The kernel drops an flock when its holder dies, however it dies (SIGKILL included), and it
    is seen across PID namespaces; so "the lock file is not locked" is the proof that the
    owner is gone, which a PID check alone cannot give (PIDs are reused, and a container may
    share /dev/shm but not PIDs). The file is locked before it gets its name (temp + rename),
    so a sweep never sees it unlocked while its owner lives.
    """

    def __init__(self, prefix: str, shm_dir: str = DEFAULT_SHM_DIR) -> None:
        self.path = os.path.join(shm_dir, prefix + LOCK_SUFFIX)
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with contextlib.suppress(OSError):  # a full tmpfs: the pid is in the name anyway
                os.write(fd, f"{os.getpid()}\n".encode())
            os.rename(tmp, self.path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        self._fd = fd

    def release(self) -> None:
        """Remove the lock file (last, after what it guards) and drop the lock."""
        if self._fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._fd)
        self._fd = -1


def _owner_gone(prefix: str, pid: int, shm_dir: str) -> bool:
    """Whether the owner of ``prefix`` is dead: its lock file is free; with no lock file (an
    in-process saver, or an owner between removing its things and its lock), its PID is gone."""
    lock = os.path.join(shm_dir, prefix + LOCK_SUFFIX)
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return not pid_alive(pid)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing drops our probe lock too
    return True


def _remove(path: str) -> bool:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("cannot remove the leftover %s: %s", path, exc)
        return False
    return True


def _newest_mtime(path: str) -> float:
    """The newest modification time of ``path`` and everything under it."""
    newest = os.path.getmtime(path)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            with contextlib.suppress(OSError):
                newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
    return newest


def _sweep_legacy_tmp(tmp_dir: str) -> list[str]:
    """Remove the old release's ``dlrover_agent_*`` temp folders idle for LEGACY_TMP_IDLE_S."""
    removed = []
    try:
        names = [n for n in os.listdir(tmp_dir) if n.startswith(LEGACY_TMP_PREFIX)]
    except OSError:
        return []
    for name in names:
        path = os.path.join(tmp_dir, name)
        try:
            idle = time.time() - _newest_mtime(path)
        except OSError:
            continue
        if os.path.isdir(path) and idle > LEGACY_TMP_IDLE_S and _remove(path):
            removed.append(path)
    return removed


def sweep(
    shm_dir: str = DEFAULT_SHM_DIR,
    tmp_dir: str | None = None,
    job: str | None = None,
    spill_dir: str | None = None,
) -> list[str]:
    """Remove the shared-memory segments, lock files and temp folders whose owner is dead
    (``job``: only that job's); returns the paths removed. What a live process owns, of this
    job or another, is never touched. ``spill_dir``: where savers put buffers that did not fit
    in ``shm_dir`` (owner locks stay in ``shm_dir``). Without ``job``, also the old release's
    temp folders (``dlrover_agent_*``, no owner in the name) once idle for a day."""
    tmp_dir = tmp_dir or runtime_dir()
    groups: dict[str, list[str]] = {}
    owners: dict[str, int] = {}
    folders = (shm_dir, tmp_dir) if spill_dir is None else (shm_dir, tmp_dir, spill_dir)
    for where in dict.fromkeys(folders):
        try:
            names = os.listdir(where)
        except OSError:
            continue
        for name in names:
            owned = parse(name)
            if owned is not None:
                if job is not None and owned.job != label(job):
                    continue
                groups.setdefault(owned.prefix, []).append(os.path.join(where, name))
                owners[owned.prefix] = owned.pid
                continue
            legacy = _LEGACY.match(name)
            if legacy is not None and job is None and where == shm_dir:
                key = f"legacy:{legacy.group('pid')}"
                groups.setdefault(key, []).append(os.path.join(where, name))
                owners[key] = int(legacy.group("pid"))
    removed: list[str] = [] if job is not None else _sweep_legacy_tmp(tmp_dir)
    for prefix, paths in groups.items():
        pid = owners[prefix]
        gone = (
            not pid_alive(pid)
            if prefix.startswith("legacy:")
            else _owner_gone(prefix, pid, shm_dir)
        )
        if not gone:
            continue
        # The lock file goes last: until then a second sweep still sees the owner as gone.
        for path in sorted(paths, key=lambda p: p.endswith(LOCK_SUFFIX)):
            if _remove(path):
                removed.append(path)
    if removed:
        log.info("removed %d leftovers of dead processes: %s", len(removed), " ".join(removed))
    return removed


def sweep_configured(job: str | None = None) -> list[str]:
    """`sweep` of the folders this process's environment names (DLROVER_CKPT_SHM_DIR and
    DLROVER_CKPT_SPILL_DIR); a wrong setting is logged and the defaults swept (a tidy-up must
    not fail over what the saver itself reports)."""
    try:
        shm_dir, spill_dir = shm_dirs_from_env()
    except ValueError as exc:
        log.warning("%s; sweeping the default folders", exc)
        shm_dir, spill_dir = DEFAULT_SHM_DIR, None
    return sweep(shm_dir, job=job, spill_dir=spill_dir)
