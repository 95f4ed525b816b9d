"""Faults as DLROVER_FAULTS describes them: parsed here, for the injector and the node check.

Training scripts fire them with ``dlrover.testing.faults.maybe_inject(step)``; the agent's node
check reads its own (``node_check_faults``). ``DLROVER_FAULTS`` holds faults
separated by ``;``, each ``kind:key=value:...``, for example::

    kill:rank=1:step=5;raise:rank=0:step=3:restart=1;hang:rank=1:step=4;slow:rank=1:factor=3

Kinds: ``kill`` (SIGKILL itself), ``raise`` (RuntimeError), ``hang`` (block, forever or for
``seconds``), ``slow`` (from ``step`` on the worker runs ``factor`` times slower: under an
agent it is throttled, dlrover/faults/throttle.py, elsewhere each step sleeps; the node
check's compute test too), ``exit`` (``os._exit(code)``, as a native library calling exit
would), ``kill_agent`` (SIGKILL the pid in DLROVER_AGENT_PID), ``lose_node`` (the node's
machine is gone: SIGKILL the agent, delete its flash-checkpoint shared memory, SIGKILL
itself), ``freeze_node`` (the node's machine is cut off but its processes live on: SIGSTOP the
agent, then itself; the engine still runs the node, the master hears nothing more from it),
``kill_master`` (SIGKILL the job's master: the pid in the `dlrover submit` record of
DLROVER_JOB_NAME under DLROVER_HOME; `dlrover submit` starts it again on its state),
``fill_disk`` (fill the filesystem of ``path`` with a file until ENOSPC, and remove the file
``seconds`` later, default 5, from a process of its own: the fault outlives a killed worker;
``inf``: never; only on a small filesystem made for it), ``collective_fail`` (the node
check's collective test fails on that node: give ``node``), ``oom`` (allocate and touch memory
in 64 MiB chunks until the kernel's OOM killer ends the process: run it under a memory limit),
``pending`` (a replacement node, of slot ``node`` or of any, waits before it registers until
the file ``until`` exists: a pod pending for room, released when a test says so; the agent
reads it).
Keys: ``rank`` (global RANK; default
every rank), ``node`` (the node slot an engine launched, the N of ``<job>-worker-N-<attempt>``,
on its first attempt only: a replacement is another machine; ``dlrover-run --node-rank N``
without an engine), ``step`` (required, except for slow and collective_fail: default 0),
``restart`` (TORCHELASTIC_RESTART_COUNT the fault fires on; default 0 so a restarted worker
recovers; ``*`` for every restart), ``once`` (a file path: the fault fires only if the file does
not exist yet, and creates it; a replacement node's workers, whose restart count starts at 0
again, then do not repeat it). Example: ``slow:node=1:factor=3`` makes node 1 a straggler.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum

from dlrover.constants import ENV_AGENT_PID as ENV_AGENT_PID
from dlrover.constants import ENV_FAULTS as ENV_FAULTS

_COMMON_KEYS = frozenset({"rank", "node", "step", "restart", "once"})
_STEPLESS = frozenset({"slow", "collective_fail", "pending"})
_EXTRA_KEYS = {
    "pending": frozenset({"until"}),
    "exit": frozenset({"code"}),
    "slow": frozenset({"factor"}),
    "hang": frozenset({"seconds"}),
    "fill_disk": frozenset({"path", "seconds"}),
}


class FaultKind(Enum):
    """What a fault does: kill (SIGKILL itself), raise (InjectedFault), hang, slow, exit
    (``os._exit``), kill_agent (SIGKILL the agent), lose_node, freeze_node, kill_master (SIGKILL the job's
    master), fill_disk (fill a filesystem for a while), collective_fail (the node check's
    collective), oom or pending (a replacement node waits for a file)."""

    KILL = "kill"
    RAISE = "raise"
    HANG = "hang"
    SLOW = "slow"
    EXIT = "exit"
    KILL_AGENT = "kill_agent"
    LOSE_NODE = "lose_node"
    FREEZE_NODE = "freeze_node"
    KILL_MASTER = "kill_master"
    FILL_DISK = "fill_disk"
    COLLECTIVE_FAIL = "collective_fail"
    OOM = "oom"
    PENDING = "pending"


class FaultSpecError(ValueError):
    """DLROVER_FAULTS cannot be parsed; the message names the item and what is allowed."""


@dataclass(frozen=True)
class Fault:
    """One fault: what happens, on which rank, at which step, in which restart."""

    kind: FaultKind
    step: int
    rank: int | None = None
    """None: every rank."""
    restart: int | None = 0
    """None: every restart count."""
    code: int = 1
    factor: float = 1.0
    seconds: float | None = None
    """For hang: block this long then go on; None blocks until killed."""
    once: str = ""
    """A marker file: fire only if it does not exist yet (and create it)."""
    node: int | None = None
    """The node slot it is meant for (first attempt only); None: every node."""
    until: str = ""
    """For pending: the file whose creation releases the node."""
    path: str = ""
    """For fill_disk: a folder on the filesystem to fill."""

    def claim(self) -> bool:
        """True if the fault may fire now; with `once`, only the first claim anywhere succeeds."""
        if not self.once:
            return True
        try:
            os.close(os.open(self.once, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            return False
        return True

    def applies(self, rank: int, restart_count: int, node: tuple[int, int] | None = None) -> bool:
        """Whether the fault is meant for the worker of global ``rank`` in restart
        ``restart_count`` on ``node`` (its slot and attempt, see `node_slot`)."""
        return (
            (self.rank is None or self.rank == rank)
            and (self.restart is None or self.restart == restart_count)
            and self.on_node(node)
        )

    def on_node(self, node: tuple[int, int] | None) -> bool:
        """Whether the fault is meant for ``node`` (slot, attempt): any node without a ``node``
        key, else that slot's first attempt."""
        return self.node is None or (node is not None and node == (self.node, 0))

    def describe(self) -> str:
        """One line for logs, e.g. ``kill on rank 1 at step 5 (restart 0)``."""
        where = "every rank" if self.rank is None else f"rank {self.rank}"
        when = "every restart" if self.restart is None else f"restart {self.restart}"
        return f"{self.kind.value} on {where} at step {self.step} ({when})"


def _int(item: str, key: str, value: str, minimum: int) -> int:
    try:
        number = int(value)
    except ValueError:
        raise FaultSpecError(f"{item!r}: {key}={value!r} is not an integer") from None
    if number < minimum:
        raise FaultSpecError(f"{item!r}: {key} must be >= {minimum}, got {number}")
    return number


def _float(item: str, key: str, value: str, minimum: float) -> float:
    try:
        number = float(value)
    except ValueError:
        raise FaultSpecError(f"{item!r}: {key}={value!r} is not a number") from None
    if not number >= minimum:
        raise FaultSpecError(f"{item!r}: {key} must be >= {minimum}, got {value}")
    return number


def parse_fault(item: str) -> Fault:
    """Parse one ``kind:key=value:...`` item."""
    kind_text, *pairs = item.strip().split(":")
    try:
        kind = FaultKind(kind_text)
    except ValueError:
        kinds = ", ".join(kind.value for kind in FaultKind)
        raise FaultSpecError(
            f"{item!r}: unknown fault kind {kind_text!r}; use one of {kinds}"
        ) from None
    allowed = _COMMON_KEYS | _EXTRA_KEYS.get(kind.value, frozenset())
    values: dict[str, str] = {}
    for pair in pairs:
        key, separator, value = pair.partition("=")
        if not separator or key not in allowed:
            raise FaultSpecError(
                f"{item!r}: bad field {pair!r}; {kind.value} takes {', '.join(sorted(allowed))}"
            )
        values[key] = value
    if "step" not in values and kind.value not in _STEPLESS:
        raise FaultSpecError(f"{item!r}: {kind.value} needs step=N")
    if kind is FaultKind.COLLECTIVE_FAIL and "node" not in values:
        raise FaultSpecError(f"{item!r}: collective_fail needs node=N")
    if kind is FaultKind.PENDING and not values.get("until"):
        raise FaultSpecError(f"{item!r}: pending needs until=PATH")
    if kind is FaultKind.FILL_DISK and not values.get("path"):
        raise FaultSpecError(f"{item!r}: fill_disk needs path=DIR (on the filesystem to fill)")
    if kind is FaultKind.SLOW and "factor" not in values:
        raise FaultSpecError(f"{item!r}: slow needs factor=X (X >= 1)")
    restart = values.get("restart", "0")
    return Fault(
        kind=kind,
        step=_int(item, "step", values.get("step", "0"), 0),
        rank=_int(item, "rank", values["rank"], 0) if values.get("rank", "*") != "*" else None,
        restart=None if restart == "*" else _int(item, "restart", restart, 0),
        code=_int(item, "code", values.get("code", "1"), 0),
        factor=_float(item, "factor", values.get("factor", "1"), 1.0),
        seconds=_float(item, "seconds", values["seconds"], 0.0) if "seconds" in values else None,
        once=values.get("once", ""),
        node=_int(item, "node", values["node"], 0) if "node" in values else None,
        until=values.get("until", ""),
        path=values.get("path", ""),
    )


def node_slot(node_id: str, node_rank: int = -1) -> tuple[int, int] | None:
    """(slot, attempt) of a node an engine named ``<job>-<role>-<slot>-<attempt>``; else
    (``node_rank``, 0) for a node started by hand with --node-rank; else None."""
    parts = node_id.rsplit("-", 2)
    if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
        return int(parts[1]), int(parts[2])
    return (node_rank, 0) if node_rank >= 0 else None


def node_check_faults(text: str, node: tuple[int, int] | None) -> tuple[float, bool]:
    """What the node check of ``node`` injects: (slow factor of its compute test, whether its
    collective test fails), from a DLROVER_FAULTS value."""
    factor, fail = 1.0, False
    for fault in parse_faults(text):
        if fault.node is None or not fault.on_node(node):
            continue  # node checks take node faults only, not a worker's rank faults
        if fault.kind is FaultKind.SLOW:
            factor *= fault.factor
        elif fault.kind is FaultKind.COLLECTIVE_FAIL:
            fail = True
    return factor, fail


def pending_until(text: str, node: tuple[int, int] | None) -> str:
    """The file a replacement ``node`` (slot, attempt >= 1) waits for before it registers, from
    a DLROVER_FAULTS value's ``pending`` item; "" when none applies."""
    for fault in parse_faults(text):
        replacement = node is not None and node[1] >= 1 and fault.node in (None, node[0])
        if fault.kind is FaultKind.PENDING and replacement:
            return fault.until
    return ""


def parse_faults(text: str) -> tuple[Fault, ...]:
    """Parse a whole DLROVER_FAULTS value; empty items are ignored."""
    return tuple(parse_fault(item) for item in text.split(";") if item.strip())
