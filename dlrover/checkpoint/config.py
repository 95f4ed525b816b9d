"""Defaults and environment-variable names of the flash-checkpoint subsystem."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from dlrover.constants import ENV_CHECKPOINT_SOCKET
from dlrover.constants import ENV_CKPT_BUFFERS as ENV_BUFFERS
from dlrover.constants import ENV_CKPT_PERSIST_PRIORITY as ENV_PERSIST_PRIORITY
from dlrover.constants import ENV_CKPT_REPLICA_MIB_S as ENV_REPLICA_MIB_S
from dlrover.constants import ENV_CKPT_SHM_DIR as ENV_SHM_DIR
from dlrover.constants import ENV_CKPT_SPILL_DIR as ENV_SPILL_DIR
from dlrover.envvars import number_from_env

__all__ = [
    "ENV_CHECKPOINT_SOCKET",
    "DEFAULT_SHM_DIR",
    "DEFAULT_KEEP_LAST",
    "DEFAULT_PERSIST_WAIT_S",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "DEFAULT_COPY_WAIT_S",
    "PERSIST_CHUNK_BYTES",
    "ENV_PERSIST_PRIORITY",
    "persist_priority_from_env",
    "ENV_BUFFERS",
    "buffers_from_env",
    "CheckpointEnv",
    "run_in_background",
    "ENV_REPLICA_MIB_S",
    "ENV_SHM_DIR",
    "ENV_SPILL_DIR",
    "shm_dirs_from_env",
    "replica_bandwidth_from_env",
    "LATEST_FILE",
    "MANIFEST_FILE",
    "MAX_SAVER_CONNECTIONS",
]

DEFAULT_SHM_DIR = "/dev/shm"
"""Where segments live; a tmpfs, so its pages are host memory that outlives a worker."""
MAX_SAVER_CONNECTIONS = 256
"""Connections a saver serves at once: a node's ranks hold one each (two with an overlap
thread), far fewer than this; more are refused rather than each holding a thread."""
DEFAULT_KEEP_LAST = 3
"""Persisted steps kept on storage; older complete steps are deleted after a commit."""
DEFAULT_PERSIST_WAIT_S = 600.0
"""How long a persist waits for every local saving rank to finish copying the same step."""
DEFAULT_REQUEST_TIMEOUT_S = 60.0
"""Deadline of one request from a worker to its saver."""
DEFAULT_COPY_WAIT_S = 600.0
"""How long a DISK save waits for the previous persist of its segment to finish."""
PERSIST_CHUNK_BYTES = 64 * 1024 * 1024
"""Bytes streamed from a segment to storage per write call."""
LATEST_FILE = "latest"
"""Marker file holding the newest committed step, written last by temp + rename."""
MANIFEST_FILE = "manifest.json"
"""Per-step list of files, sizes and CRC32 checksums; its presence means 'committed'."""


def buffers_from_env(env: Mapping[str, str] | None = None) -> int:
    """The buffer count from DLROVER_CKPT_BUFFERS (default 2); ValueError naming the variable
    for anything but 1 or 2."""
    raw = (os.environ if env is None else env).get(ENV_BUFFERS, "").strip()
    if not raw:
        return 2
    if raw not in ("1", "2"):
        raise ValueError(f"{ENV_BUFFERS}={raw!r}: give 1 or 2 (buffers per saving rank)")
    return int(raw)


DEFAULT_PERSIST_PRIORITY = "batch"


def persist_priority_from_env(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(scheduling policy, niceness) from DLROVER_CKPT_PERSIST_PRIORITY; ValueError naming the
    variable for a value it does not know."""
    raw = (os.environ if env is None else env).get(ENV_PERSIST_PRIORITY, "").strip().lower()
    raw = raw or DEFAULT_PERSIST_PRIORITY
    if raw == "idle":
        return os.SCHED_IDLE, 0
    name, _, nice = raw.partition(":")
    policies = {"batch": os.SCHED_BATCH, "nice": os.SCHED_OTHER}
    if name in policies and (nice.isdigit() and int(nice) <= 19 or name == "batch" and not nice):
        return policies[name], int(nice or 0)
    raise ValueError(
        f"{ENV_PERSIST_PRIORITY}={raw!r}: give batch, batch:<0..19>, idle or nice:<0..19> (the "
        "CPU priority of checkpoint persists)"
    )


def run_in_background() -> None:
    """Set the calling thread's CPU priority for persists and replica pushes
    (DLROVER_CKPT_PERSIST_PRIORITY, default SCHED_BATCH at nice 0: an equal share of the
    CPU, the one priority measured to keep a persist within about 2x its time on a node the
    trainers saturate; SCHED_IDLE starved it there). Linux applies it per thread, so the
    trainers are not touched. An unknown value is logged and the default used."""
    tid = threading.get_native_id()
    logger = logging.getLogger(__name__)
    try:
        policy, nice = persist_priority_from_env()
    except ValueError as exc:
        logger.warning("%s; using %s", exc, DEFAULT_PERSIST_PRIORITY)
        policy, nice = os.SCHED_BATCH, 0
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(0))
    except (OSError, AttributeError) as exc:
        logger.debug("cannot set a persist thread's scheduling policy: %s", exc)
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except (OSError, AttributeError) as exc:
        logger.debug("cannot set a persist thread's niceness: %s", exc)


DEFAULT_REPLICA_MIB_S = 1024.0


def replica_bandwidth_from_env(env: Mapping[str, str] | None = None) -> float | None:
    """The replica push cap in bytes/s from DLROVER_CKPT_REPLICA_MIB_S (default 1024 MiB/s;
    None: no cap); ValueError naming the variable for a value that is not a number >= 0."""
    mib_s = number_from_env(
        ENV_REPLICA_MIB_S, DEFAULT_REPLICA_MIB_S, "MiB/s as a number >= 0 (0: no cap)", env
    )
    return mib_s * 2**20 if mib_s else None


def _folder(name: str, raw: str) -> str:
    if not os.path.isdir(raw):
        raise ValueError(f"{name}={raw!r}: no such folder (give an existing folder)")
    return raw


def shm_dirs_from_env(env: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """(shared-memory folder, spill folder or None) from DLROVER_CKPT_SHM_DIR (default
    /dev/shm) and DLROVER_CKPT_SPILL_DIR (default the temp folder; ``off``: None); ValueError
    naming the variable for a folder that does not exist."""
    env = os.environ if env is None else env
    raw = env.get(ENV_SHM_DIR, "").strip()
    shm_dir = _folder(ENV_SHM_DIR, raw) if raw else DEFAULT_SHM_DIR
    raw = env.get(ENV_SPILL_DIR, "").strip()
    if raw.lower() == "off":
        return shm_dir, None
    return shm_dir, _folder(ENV_SPILL_DIR, raw) if raw else tempfile.gettempdir()


@dataclass(frozen=True)
class CheckpointEnv:
    """The flash-checkpoint settings a node reads from its environment, read in one place
    (`from_env`). The persist threads' CPU priority is not here: each thread reads it as it
    starts (`run_in_background`) and falls back to the default with a warning."""

    replica_bytes_s: float | None
    """Cap on the replica push rate in bytes/s (DLROVER_CKPT_REPLICA_MIB_S); None: no cap."""
    buffers: int
    """Shared-memory buffers per saving rank (DLROVER_CKPT_BUFFERS): 1 or 2."""
    shm_dir: str = DEFAULT_SHM_DIR
    """The tmpfs folder of the buffers (DLROVER_CKPT_SHM_DIR)."""
    spill_dir: str | None = None
    """Where buffers go when ``shm_dir`` has no room (DLROVER_CKPT_SPILL_DIR); None: nowhere."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CheckpointEnv:
        """Read every field; ValueError names the first variable that is wrong and what to give."""
        shm_dir, spill_dir = shm_dirs_from_env(env)
        return cls(replica_bandwidth_from_env(env), buffers_from_env(env), shm_dir, spill_dir)
