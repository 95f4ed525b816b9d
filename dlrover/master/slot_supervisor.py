"""The one supervisor of every node slot of the job: all-reduce workers, TensorFlow roles and
embedding servers.

A slot is a (role, index) pair; its nodes are its attempts (``<job>-<role>-<index>-<attempt>``).
The supervisor keeps, per slot, the current attempt, how many attempts the master launched by
plan (a resize, a scale-out into a slot used before, a relaunch at a new size: they do not use up
``max_relaunches``) and the memory of every attempt killed for memory. Every replacement goes
through it in one sequence: decide (the `RelaunchPolicy`), record (the failure log, once), save
the next attempt (so a restarted master launches the same one), and hand the attempt back for
the role's controller to launch. The controllers keep only what their role adds: membership for
workers, the cluster spec for TensorFlow, the placement and replica restore for embedding servers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from dlrover.api.master import FailureClass, FailureRecord
from dlrover.constants import CANNOT_START_EXIT_CODE
from dlrover.decisions import FailureAction
from dlrover.engines.base import FailureReason, NodeEvent, NodeSpec, Resources
from dlrover.master.relaunch_policy import RelaunchPolicy, failure_class_of
from dlrover.master.state_store import MemoryStateStore, StateStore

__all__ = ["NodeBuilder", "SlotRecord", "SlotSupervisor", "Verdict"]

logger = logging.getLogger(__name__)

NAMESPACE = "slots"

NodeBuilder = Callable[[int, int], NodeSpec]
"""A role's hook: the spec of attempt ``attempt`` of slot ``index`` (named as the engine knows it,
with the role's default resources)."""


class FailureLog(Protocol):
    """Where the supervisor records failures (`Diagnostics`)."""

    def record_failure(self, record: FailureRecord) -> None:
        """Keep one classified failure."""


@dataclasses.dataclass
class SlotRecord:
    """One slot's history: its current attempt, the attempts launched by plan, its OOM kills."""

    role: str
    index: int
    attempt: int = 0
    """The current attempt (the spec's relaunch_count)."""
    planned: int = 0
    """Attempts the master launched by plan; they do not use up max_relaunches."""
    resources: Resources | None = None
    """The current attempt's resources (grown after an OOM kill, resized); None before the
    slot's first attempt is saved."""
    oom_kills: list[int] = dataclasses.field(default_factory=list)
    """The memory (MiB) of each attempt killed for memory."""

    @property
    def used(self) -> int:
        """Relaunches used by failures (and replaced stragglers)."""
        return max(0, self.attempt - self.planned)

    def to_json(self) -> dict[str, Any]:
        """The record as the master's state keeps it (`from_json` reads it back)."""
        return {
            "attempt": self.attempt,
            "planned": self.planned,
            "resources": None if self.resources is None else dataclasses.asdict(self.resources),
            "oom_kills": self.oom_kills,
        }

    @classmethod
    def from_json(cls, role: str, index: int, raw: dict[str, Any]) -> SlotRecord:
        """The record `to_json` wrote for slot (role, index)."""
        resources = raw.get("resources")
        return cls(
            role,
            index,
            attempt=int(raw["attempt"]),
            planned=int(raw.get("planned", 0)),
            resources=None if resources is None else Resources(**resources),
            oom_kills=[int(m) for m in raw.get("oom_kills", [])],
        )


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the supervisor decided for a failed attempt."""

    action: FailureAction
    reason: str
    """Why (the policy's words; for an OOM kill at the cap, that it cannot grow)."""
    replacement: NodeSpec | None = None
    """The next attempt, saved (RELAUNCH_NODE only): the controller launches it."""
    cannot_grow: bool = False
    """The attempt was killed for memory at the cap (action FAIL)."""
    oom_kills: tuple[int, ...] = ()
    """The memory (MiB) of each of the slot's attempts killed for memory, oldest first."""


class SlotSupervisor:
    """Relaunches every slot of the job: one record per slot, saved in ``store`` (a master
    restarted on it resumes the same attempts). Thread-safe; roles register their builder with
    `role` before they ask for a slot's attempts."""

    def __init__(
        self,
        failures: FailureLog,
        policy: RelaunchPolicy,
        store: StateStore | None = None,
    ) -> None:
        self.policy = policy
        self._failures = failures
        self._store = store or MemoryStateStore()
        self._lock = threading.Lock()
        self._builders: dict[str, NodeBuilder] = {}
        self._slots: dict[tuple[str, int], SlotRecord] = {}
        for key, raw in self._store.items(NAMESPACE).items():
            role, _, index = key.rpartition("-")
            record = SlotRecord.from_json(role, int(index), _decode(raw))
            self._slots[(role, record.index)] = record

    # --- roles and their slots ----------------------------------------------------------------
    def role(self, role: str, build: NodeBuilder) -> None:
        """Register ``role``'s builder: how an attempt of one of its slots is specified."""
        self._builders[role] = build

    def record(self, role: str, index: int) -> SlotRecord | None:
        """A copy of slot (role, index)'s record; None for a slot never launched."""
        with self._lock:
            record = self._slots.get((role, index))
            if record is None:
                return None
            return dataclasses.replace(record, oom_kills=list(record.oom_kills))

    def current(self, role: str, index: int) -> NodeSpec:
        """The slot's current attempt: the one a master before this one saved, else the first."""
        with self._lock:
            record = self._slots.get((role, index))
            if record is None:
                record = self._new(role, index)
            spec = self._spec(record)
            if record.resources is None:
                record.resources = spec.resources
                self._save(record)
            return spec

    def open(self, role: str, index: int, fresh: bool = False) -> NodeSpec:
        """A slot the master adds (a scale-out): its first attempt, or, for a slot used before
        and scaled in since, its next (a new node id; launched by plan). ``fresh``: a slot used
        before starts with its whole relaunch budget and no OOM history (a TensorFlow worker
        slot scaled in and out again), else its failures still count. Saved."""
        with self._lock:
            record = self._slots.get((role, index))
            if record is None:
                record = self._new(role, index)
            else:  # the role's resources now, not those of the slot's last attempt
                record.attempt += 1
                record.planned += 1
                record.resources = None
                if fresh:
                    record.planned = record.attempt
                    record.oom_kills = []
            spec = self._spec(record)
            record.resources = spec.resources
            self._save(record)
            return spec

    def used(self, role: str, index: int) -> int:
        """Relaunches slot (role, index) used by failures."""
        record = self.record(role, index)
        return 0 if record is None else record.used

    # --- replacements -------------------------------------------------------------------------
    def judge(
        self,
        event: NodeEvent,
        label: str = "",
        alive_nodes: int = 0,
        min_nodes: int = 1,
        record: bool = True,
        cause: str = "",
    ) -> Verdict:
        """A failure of a slot's attempt: decide (relaunch, go on smaller, fail), record it in
        the failure log (unless ``record`` is False: recorded elsewhere, or a replacement that
        died before it started), and for a relaunch save the next attempt (more memory after an
        OOM kill) and return it. ``label`` starts the record's cause (``ps``, ``embedding server
        1``); ``alive_nodes`` and ``min_nodes``: the survivors may go on without the slot
        (all-reduce workers). A node that exited with CANNOT_START_EXIT_CODE is not relaunched:
        its program cannot start (``cause``, where the controller knows it, says why)."""
        with self._lock:
            slot = self._slots.get((event.spec.role, event.spec.rank))
            if slot is None:
                slot = self._new(event.spec.role, event.spec.rank)
                slot.attempt = event.spec.relaunch_count
            if event.reason is FailureReason.OOM_KILLED:
                slot.oom_kills.append(event.spec.resources.memory_mib)
            decision = self.policy.decide(
                event.node_id,
                self.policy.loss_reason(event),
                max(0, event.spec.relaunch_count - slot.planned),
                alive_nodes=alive_nodes,
                min_nodes=min_nodes,
            )
            action, reason, spec = decision.action, decision.reason, None
            cannot_grow = False
            if event.exit_code == CANNOT_START_EXIT_CODE:
                # Its program cannot start: another attempt would not either.
                action = FailureAction.FAIL
                what = f"{label} {event.spec.rank}" if label else f"node {event.spec.rank}"
                reason = (
                    f"{what} ({event.node_id}) cannot start its program: "
                    f"{cause or event.message}; not relaunched: fix the command"
                )
                self._save(slot)
            elif action is FailureAction.RELAUNCH_NODE:
                spec = self.policy.replacement(event)
                if spec is None:
                    action, cannot_grow = FailureAction.FAIL, True
                    reason = (
                        f"node {event.node_id} was OOM-killed and cannot grow: the memory cap is "
                        f"{self.policy.oom.max_memory_mib} MiB"
                    )
                else:
                    spec = self._attempt(slot, spec, planned=False)
            else:
                self._save(slot)
            verdict = Verdict(action, reason, spec, cannot_grow, tuple(slot.oom_kills))
        if record:
            why = (
                cause
                or event.message
                or (event.reason.value if event.reason else event.state.value)
            )
            self._failures.record_failure(
                FailureRecord(
                    time.time(),
                    event.node_id,
                    failure_class_of(event),
                    action.value,
                    f"{label}: {why}" if label else why,
                )
            )
        return verdict

    def replace(
        self,
        spec: NodeSpec,
        resources: Resources | None = None,
        failure: tuple[FailureClass, str] | None = None,
    ) -> NodeSpec | None:
        """A replacement the master chooses for the live attempt ``spec``: with ``failure`` (a
        runtime straggler: class and cause) it uses a relaunch and is recorded, and None comes
        back when the slot has none left (keep the node: a slow one is better than none);
        without, it is launched by plan (a resize to ``resources``). Returns the next attempt,
        saved."""
        with self._lock:
            slot = self._slots.get((spec.role, spec.rank)) or self._new(spec.role, spec.rank)
            if failure is not None and slot.used >= self.policy.max_relaunches:
                return None
            nxt = self._attempt(slot, spec.replacement(resources), planned=failure is None)
        if failure is not None:
            self._failures.record_failure(
                FailureRecord(time.time(), spec.node_id, failure[0], "relaunch_node", failure[1])
            )
        return nxt

    def keep(self, spec: NodeSpec) -> None:
        """Save ``spec`` as its slot's current attempt (an attempt adopted as it is)."""
        with self._lock:
            slot = self._slots.get((spec.role, spec.rank)) or self._new(spec.role, spec.rank)
            self._attempt(slot, spec, planned=False)

    # --- inside the lock ----------------------------------------------------------------------
    def _new(self, role: str, index: int) -> SlotRecord:
        record = SlotRecord(role, index)
        self._slots[(role, index)] = record
        return record

    def _attempt(self, slot: SlotRecord, spec: NodeSpec, planned: bool) -> NodeSpec:
        """Make ``spec`` the slot's current attempt (named by the role's builder), saved."""
        if planned:
            slot.planned += 1
        slot.attempt, slot.resources = spec.relaunch_count, spec.resources
        self._save(slot)
        return self._spec(slot)

    def _spec(self, slot: SlotRecord) -> NodeSpec:
        build = self._builders.get(slot.role)
        if build is None:
            raise KeyError(f"role {slot.role!r} has no builder: register it with role()")
        spec = build(slot.index, slot.attempt)
        if slot.resources is not None:
            spec = dataclasses.replace(spec, resources=slot.resources)
        return spec

    def _save(self, slot: SlotRecord) -> None:
        self._store.put_json(NAMESPACE, f"{slot.role}-{slot.index}", slot.to_json())


def _decode(raw: bytes) -> dict[str, Any]:
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError(f"a slot record is not an object: {raw[:80]!r}")
    return value
