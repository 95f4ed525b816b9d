"""Hang detection's settings and what it learns: the phases of a worker's life, the timeout of
each, and the history a timeout is learned from (standard library only: the CLI, the job spec,
the agent and the master read it).

A worker is always in one phase: ``startup`` (from its start to its first step), ``step``
(between two steps), or a section the script or the library marks (``checkpoint``, ``eval``,
``data`` or any name: `dlrover.trainer.section`). Each phase's timeout is learned from the job's
own durations of it, ``LEARN_FACTOR`` times their 99th percentile, between the phase's floor and
cap; before enough of them were seen, the phase's default holds. A learned timeout only starts a
check: the agent then confirms the hang from the worker's stacks (`dlrover.agent.hang_watch`).
A timeout the user gives is obeyed as it is.

``--hang-timeout`` (and the job spec's ``hang_timeout``) takes:

- ``auto`` (the default): every phase learned;
- ``0`` or ``off``: no hang detection (stalls are still logged, `--hang-warning-timeout`);
- ``S`` (seconds): every phase fixed at S from the worker's first step (start-up is learned);
- a comma list of ``PHASE=S``, ``PHASE=auto``, ``PHASE=off``, ``min=S`` (every learned phase's
  floor) and ``max=S`` (its cap), e.g. ``step=120,eval=off,min=10``; phases not named are
  learned.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

STARTUP = "startup"
STEP = "step"
CHECKPOINT = "checkpoint"
EVAL = "eval"
DATA = "data"

LEARN_FACTOR = 3.0
"""A learned timeout is this many times the 99th percentile of the phase's durations so far."""
PERCENTILE = 0.99
KEEP = 200
"""Durations kept per phase (the longest): the 99th percentile of up to 20,000 is exact, of more
it is read from the longest 200 (a higher percentile: a longer, safer timeout)."""


@dataclass(frozen=True)
class PhaseDefaults:
    """How a phase's timeout is learned: at least ``floor``, at most ``cap``, and ``default``
    until ``min_samples`` durations were seen."""

    floor: float
    default: float
    cap: float
    min_samples: int


PHASES: Mapping[str, PhaseDefaults] = {
    STARTUP: PhaseDefaults(floor=300.0, default=1800.0, cap=3600.0, min_samples=1),
    STEP: PhaseDefaults(floor=60.0, default=300.0, cap=1800.0, min_samples=10),
    CHECKPOINT: PhaseDefaults(floor=120.0, default=1800.0, cap=3600.0, min_samples=3),
    EVAL: PhaseDefaults(floor=120.0, default=1800.0, cap=3600.0, min_samples=3),
    DATA: PhaseDefaults(floor=60.0, default=300.0, cap=1800.0, min_samples=10),
}
"""The phases known by name; any other section a script marks is learned as ``eval`` is."""


def defaults_of(phase: str) -> PhaseDefaults:
    """A phase's defaults (a section without its own: ``eval``'s)."""
    return PHASES.get(phase, PHASES[EVAL])


class HangSpecError(ValueError):
    """A ``--hang-timeout`` / ``hang_timeout`` that cannot be read; says what is accepted."""


_ACCEPTED = (
    "auto (the default: learned per phase), 0 or off, seconds for every phase, or a comma list "
    "of PHASE=S|auto|off, min=S, max=S (e.g. step=120,eval=off,min=10)"
)


def _seconds(key: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise HangSpecError(f"--hang-timeout {key}={text}: not a number of seconds") from None
    if value < 0 or math.isnan(value) or math.isinf(value):
        raise HangSpecError(f"--hang-timeout {key}={text}: must be seconds >= 0")
    return value


@dataclass(frozen=True)
class HangSpec:
    """What ``--hang-timeout`` says: off, fixed, learned, per phase."""

    enabled: bool = True
    every: float | None = None
    """A plain number: every phase fixed at this many seconds."""
    fixed: Mapping[str, float] = field(default_factory=dict)
    """Phase -> fixed seconds; 0: that phase is never called hung."""
    floor: float | None = None
    """``min=``: the floor of every learned phase (instead of each phase's own)."""
    cap: float | None = None
    """``max=``: the cap of every learned phase."""

    @classmethod
    def parse(cls, text: str | float | int | Mapping[str, object] | None) -> HangSpec:
        """Read a ``--hang-timeout`` value (a job spec may also give a number or a mapping)."""
        if text is None:
            return cls()
        if isinstance(text, bool):
            raise HangSpecError(f"--hang-timeout {text!r}: expected {_ACCEPTED}")
        if isinstance(text, (int, float)):
            text = f"{text:g}"
        if isinstance(text, Mapping):
            text = ",".join(f"{k}={v}" for k, v in text.items())
        raw = str(text).strip().lower()
        if raw in ("", "auto"):
            return cls()
        if raw == "off":
            return cls(enabled=False)
        if "=" not in raw and "," not in raw:
            try:
                seconds = float(raw)
            except ValueError:
                raise HangSpecError(f"--hang-timeout {text}: expected {_ACCEPTED}") from None
            if seconds < 0 or math.isnan(seconds) or math.isinf(seconds):
                raise HangSpecError(f"--hang-timeout {text}: must be seconds >= 0 (0 turns it "
                                    "off)")  # fmt: skip
            return cls(enabled=False) if seconds == 0 else cls(every=seconds)
        fixed: dict[str, float] = {}
        floor = cap = None
        for part in raw.split(","):
            part = part.strip()
            if not part or part == "auto":
                continue
            key, sep, value = part.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or not key or not value:
                raise HangSpecError(f"--hang-timeout {text}: {part!r} is not KEY=VALUE; expected "
                                    f"{_ACCEPTED}")  # fmt: skip
            if not key.replace("_", "").replace("-", "").isalnum():
                raise HangSpecError(f"--hang-timeout {text}: {key!r} is not a phase name")
            if key in ("min", "max"):
                seconds = _seconds(key, value)
                if key == "min":
                    floor = seconds
                else:
                    cap = seconds
            elif value == "auto":
                fixed.pop(key, None)
            else:
                fixed[key] = 0.0 if value == "off" else _seconds(key, value)
        if floor is not None and cap is not None and floor > cap:
            raise HangSpecError(f"--hang-timeout {text}: min={floor:g} is above max={cap:g}")
        return cls(fixed=fixed, floor=floor, cap=cap)

    def text(self) -> str:
        """The value to pass on to another process's ``--hang-timeout`` (``parse`` reads it)."""
        if not self.enabled:
            return "off"
        if self.every is not None:
            return f"{self.every:g}"
        parts = [f"{k}={'off' if v == 0 else f'{v:g}'}" for k, v in sorted(self.fixed.items())]
        if self.floor is not None:
            parts.append(f"min={self.floor:g}")
        if self.cap is not None:
            parts.append(f"max={self.cap:g}")
        return ",".join(parts) or "auto"

    def floor_of(self, phase: str) -> float:
        """The floor of ``phase``'s learned timeout (``min=``, else the phase's own)."""
        return defaults_of(phase).floor if self.floor is None else self.floor

    def timeout(self, phase: str, history: PhaseHistory) -> tuple[float, bool]:
        """(seconds, learned) for ``phase`` now; 0 seconds: never hung in it. A learned timeout
        is confirmed from the worker's stacks before it counts; a fixed one counts as is."""
        if not self.enabled:
            return 0.0, False
        if self.every is not None and phase != STARTUP:
            return self.every, False  # (start-up stays learned: a plain S counts from a step)
        if phase in self.fixed:
            return self.fixed[phase], False
        d = defaults_of(phase)
        floor = self.floor_of(phase)
        cap = max(floor, d.cap if self.cap is None else self.cap)
        p99 = history.p99(phase) if history.count(phase) >= d.min_samples else None
        if p99 is None:
            return min(max(d.default, floor), cap), True
        return min(max(LEARN_FACTOR * p99, floor), cap), True


class PhaseHistory:
    """Each phase's durations so far (how many, and the longest KEEP): the 99th percentile a
    timeout is learned from. Kept by the agent across its workers' restarts and saved through
    the master (`encode`/`decode`), so a relaunched node goes on from the job's history."""

    def __init__(self) -> None:
        self._count: dict[str, int] = {}
        self._longest: dict[str, list[float]] = {}
        """Phase -> its longest durations, ascending."""

    def add(self, phase: str, seconds: float, count: int = 1) -> None:
        """``count`` durations of ``seconds`` each (several steps seen at once: their mean)."""
        if seconds < 0 or count <= 0:
            return
        self._count[phase] = self._count.get(phase, 0) + count
        longest = self._longest.setdefault(phase, [])
        if len(longest) >= KEEP and seconds <= longest[0]:
            return
        bisect.insort(longest, seconds)
        if len(longest) > KEEP:
            del longest[0]

    def count(self, phase: str) -> int:
        """How many durations of ``phase`` were seen."""
        return self._count.get(phase, 0)

    def p99(self, phase: str) -> float | None:
        """The 99th percentile of the phase's durations (None: none seen)."""
        longest = self._longest.get(phase)
        if not longest:
            return None
        above = int((1.0 - PERCENTILE) * self._count[phase])
        return longest[max(0, len(longest) - 1 - above)]

    def phases(self) -> list[str]:
        """The phases seen so far."""
        return sorted(self._count)

    def merge(self, other: PhaseHistory) -> None:
        """Take in another history's durations (a saved one, at start)."""
        for phase, longest in other._longest.items():
            extra = other._count[phase] - len(longest)
            for seconds in longest:
                self.add(phase, seconds)
            if extra > 0:
                self._count[phase] = self._count.get(phase, 0) + extra

    def encode(self) -> bytes:
        """JSON: phase -> ``{"n": count, "longest": [seconds, ...]}``."""
        doc = {p: {"n": self._count[p], "longest": self._longest.get(p, [])} for p in self._count}
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> PhaseHistory:
        """A saved history; an unreadable one is empty (it only tunes timeouts)."""
        history = cls()
        try:
            doc = json.loads(raw)
            for phase, entry in doc.items():
                longest = sorted(float(s) for s in entry["longest"])[-KEEP:]
                history._longest[str(phase)] = longest
                history._count[str(phase)] = max(int(entry["n"]), len(longest))
        except (ValueError, TypeError, KeyError, AttributeError):
            return cls()
        return history
