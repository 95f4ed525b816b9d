"""Training progress reporting: the step each worker has completed, the section it is in, and a
beat per optimizer step, for hang detection and status.

A worker's step file holds three parts, each written in place by one pwrite: the step record
(offset 0, `StepReporter`), the section record (offset SECTION_OFFSET, `section`) and the beat
(offset BEAT_OFFSET: every ``optimizer.step()`` of the process counts, `watch_optimizer_steps`),
so that the agent sees progress even of a script that reports no step.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import struct
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType, TracebackType
from typing import Any, NamedTuple

from dlrover.constants import ENV_RDZV_ROUND, ENV_STEP_FILE

_step_hooks: list[Callable[[int], None]] = []
"""What runs after each `StepReporter.report` of this process (the in-process recovery
wrapper's step-end check): a process-local list, empty unless a wrapper is active."""


def on_step_end(hook: Callable[[int], None]) -> Callable[[], None]:
    """Call ``hook(step)`` after every `StepReporter.report` of this process (it may raise to
    leave the step loop); returns the function that removes it."""
    _step_hooks.append(hook)

    def remove() -> None:
        if hook in _step_hooks:
            _step_hooks.remove(hook)

    return remove


# step, wall time, busy seconds so far, first step, its time, data-wait and checkpoint seconds,
# samples so far
_RECORD = struct.Struct("<qddqdddq")
_NO_SAMPLES_RECORD = struct.Struct("<qddqddd")  # without the samples (an older writer)
_OLD_RECORD = struct.Struct("<qdd")  # without the first step (an older writer still)


class StepRecord(NamedTuple):
    """What a worker last reported."""

    step: int
    at: float
    """Wall time of the report."""
    busy_s: float
    """The worker's own work so far, in seconds (see `StepReporter.report`): the agent divides
    its growth by the steps done to score the node against the others."""
    first_step: int = -1
    """The first step this process reported (-1: unknown), and when: goodput splits a restart's
    start-up from the steps after it."""
    first_at: float = 0.0
    data_s: float = 0.0
    """Seconds spent waiting for input so far (what the script reported)."""
    checkpoint_s: float = 0.0
    """Seconds spent blocked in checkpoint saves so far (what the script reported)."""
    samples: int = 0
    """Samples this worker trained so far (what the script reported; 0: none reported)."""


SECTION_OFFSET = 128
_SECTION = struct.Struct("<16sd16sdd")
"""The section this worker is in (name, since) and the last it left (name, seconds, when)."""
BEAT_OFFSET = 192
_BEAT = struct.Struct("<qd")
"""Optimizer steps of this process so far, and the wall time of the latest."""
SECTION_NAME_BYTES = 16


class SectionRecord(NamedTuple):
    """What a worker last wrote of its sections and beats (see `read_sections`)."""

    name: str
    """The innermost section the worker is in ("" when none)."""
    since: float
    last: str
    """The section it left most recently ("" when none yet), how long it was in it, and when it
    left."""
    last_s: float
    last_end: float
    beats: int
    """Optimizer steps so far (0: none, or not watched), and the wall time of the latest."""
    beat_at: float


class _Sections:
    """This process's open sections (innermost last) and its step file: process-local state,
    like the step hooks."""

    def __init__(self) -> None:
        self.open: list[tuple[str, float]] = []
        self.last: tuple[str, float, float] = ("", 0.0, 0.0)
        self.beats = 0
        self._fd = -1
        self._path = ""

    def fd(self) -> int:
        path = os.environ.get(ENV_STEP_FILE, "")
        if path != self._path:  # a forked worker, or a new attempt's file
            if self._fd >= 0:
                os.close(self._fd)
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644) if path else -1
            self._path = path
        return self._fd

    def write(self) -> None:
        fd = self.fd()
        if fd < 0:
            return
        name, since = self.open[-1] if self.open else ("", 0.0)
        last, last_s, last_end = self.last
        record = _SECTION.pack(_name_bytes(name), since, _name_bytes(last), last_s, last_end)
        os.pwrite(fd, record, SECTION_OFFSET)

    def beat(self) -> None:
        fd = self.fd()
        if fd >= 0:
            self.beats += 1
            os.pwrite(fd, _BEAT.pack(self.beats, time.time()), BEAT_OFFSET)


_sections = _Sections()


def _name_bytes(name: str) -> bytes:
    return name.encode()[:SECTION_NAME_BYTES]


class section(contextlib.ContextDecorator):
    """Mark a stretch of the training script as a named phase for hang detection: a context
    manager (``with section("eval"):``) or a decorator (``@section("eval")``).

    Inside it the worker is judged against that phase's own timeout (learned from the job's
    earlier times in it) instead of the step's, so a two-minute evaluation or a long save is not
    a hang. Names: ``checkpoint``, ``eval``, ``data``, or any name (at most 16 bytes are kept).
    Sections nest; the innermost counts. Outside dlrover-run it does nothing but time."""

    def __init__(self, name: str) -> None:
        if not name or len(_name_bytes(name)) != len(name.encode()):
            raise ValueError(f"section name {name!r}: 1 to {SECTION_NAME_BYTES} bytes")
        self.name = name

    def __enter__(self) -> section:
        _sections.open.append((self.name, time.time()))
        _sections.write()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for i in range(len(_sections.open) - 1, -1, -1):
            if _sections.open[i][0] == self.name:
                _, since = _sections.open.pop(i)
                now = time.time()
                _sections.last = (self.name, now - since, now)
                break
        _sections.write()


def _beat(optimizer: Any, args: Any, kwargs: Any) -> None:
    _sections.beat()


class _OptimizerWatch(importlib.abc.MetaPathFinder):
    """Registers the beat once ``torch.optim.optimizer`` is imported, without importing torch
    (a script that never uses it pays nothing)."""

    NAME = "torch.optim.optimizer"

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.NAME:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_watch(module: ModuleType) -> None:
            exec_module(module)
            _register_beat(module)

        loader.exec_module = exec_and_watch  # type: ignore[method-assign]
        return spec


def _register_beat(module: ModuleType) -> None:
    register = getattr(module, "register_optimizer_step_post_hook", None)
    if register is not None:
        register(_beat)


def watch_optimizer_steps() -> None:
    """In a worker under dlrover-run: count every ``optimizer.step()`` as a beat of progress
    (torch's global optimizer hook, registered when the script imports torch.optim)."""
    if not os.environ.get(ENV_STEP_FILE):
        return
    module = sys.modules.get(_OptimizerWatch.NAME)
    if module is not None:
        _register_beat(module)
    elif not any(isinstance(f, _OptimizerWatch) for f in sys.meta_path):
        sys.meta_path.insert(0, _OptimizerWatch())


def read_sections(path: str) -> SectionRecord | None:
    """The section and beat parts of a worker's step file (None: neither written yet)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(BEAT_OFFSET + _BEAT.size)
    except FileNotFoundError:
        return None
    part = raw[SECTION_OFFSET : SECTION_OFFSET + _SECTION.size]
    beat = raw[BEAT_OFFSET : BEAT_OFFSET + _BEAT.size]
    if len(part) < _SECTION.size and len(beat) < _BEAT.size:
        return None
    name, since, last, last_s, last_end = (
        _SECTION.unpack(part) if len(part) == _SECTION.size else (b"", 0.0, b"", 0.0, 0.0)
    )
    beats, beat_at = _BEAT.unpack(beat) if len(beat) == _BEAT.size else (0, 0.0)
    return SectionRecord(
        name.rstrip(b"\0").decode(errors="replace"),
        float(since),
        last.rstrip(b"\0").decode(errors="replace"),
        float(last_s),
        float(last_end),
        int(beats),
        float(beat_at),
    )


class StepReporter:
    """Writes the latest completed step of this worker where its agent reads it.

    One fixed-size record is overwritten in place (no allocation, no RPC on the training path), so
    reporting every step costs a few microseconds. Outside dlrover-run it does nothing.
    """

    def __init__(self, path: str | None = None) -> None:
        path = os.environ.get(ENV_STEP_FILE, "") if path is None else path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644) if path else -1
        self._busy = 0.0
        self._first: tuple[int, float] | None = None
        self._data = 0.0
        self._ckpt = 0.0
        self._samples = 0
        self._round = os.environ.get(ENV_RDZV_ROUND, "")

    def report(
        self,
        step: int,
        busy_s: float | None = None,
        *,
        data_s: float = 0.0,
        checkpoint_s: float = 0.0,
        samples: int = 0,
    ) -> None:
        """Record ``step`` with the wall time (one pwrite, no RPC); nothing outside dlrover-run.

        ``busy_s``: how long this step's own work took, without waiting for other ranks (e.g.
        forward and backward before the gradient allreduce); runtime straggler scores compare it
        across nodes. Without it, the process's CPU seconds stand in (they miss a node slowed by
        anything but its CPU). Give it on every report or on none.

        ``data_s`` and ``checkpoint_s``: how long this step waited for its input and was blocked
        in a checkpoint save; the node's step time is then broken down into data wait,
        checkpoint and compute (the rest) in `dlrover status` and the metrics.

        ``samples``: how many samples this worker trained in this step (its share of the global
        batch); the node's samples per second are then charted on the dashboard and shown by
        `dlrover top`."""
        if self._fd >= 0:
            self._write(step, busy_s, data_s, checkpoint_s, samples)
        if _step_hooks:
            for hook in list(_step_hooks):
                hook(step)

    def _write(
        self, step: int, busy_s: float | None, data_s: float, checkpoint_s: float, samples: int
    ) -> None:
        rdzv_round = os.environ.get(ENV_RDZV_ROUND, "")
        if rdzv_round != self._round:  # this process went on into a new round (in-process)
            self._round, self._first = rdzv_round, None
        if busy_s is None:
            self._busy = time.process_time()
        else:
            self._busy += busy_s
        now = time.time()
        if self._first is None:
            self._first = (step, now)
        self._data += data_s
        self._ckpt += checkpoint_s
        self._samples += samples
        record = _RECORD.pack(
            step, now, self._busy, *self._first, self._data, self._ckpt, self._samples
        )
        os.pwrite(self._fd, record, 0)

    def close(self) -> None:
        """Close the step file; later reports do nothing."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_step_file(path: str) -> StepRecord | None:
    """What was last written to `path`, or None when nothing was reported yet."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_RECORD.size)
    except FileNotFoundError:
        return None
    if len(raw) == _OLD_RECORD.size:
        step, at, busy = _OLD_RECORD.unpack(raw)
        return StepRecord(int(step), float(at), float(busy))
    if len(raw) == _NO_SAMPLES_RECORD.size:
        raw += bytes(_RECORD.size - len(raw))
    if len(raw) < _RECORD.size:
        return None
    if raw[8:16] == bytes(8):  # only a section or a beat was written yet (no step's time)
        return None
    step, at, busy, first_step, first_at, data, ckpt, samples = _RECORD.unpack(raw)
    return StepRecord(
        int(step),
        float(at),
        float(busy),
        int(first_step),
        float(first_at),
        float(data),
        float(ckpt),
        int(samples),
    )


def report_step(
    step: int,
    busy_s: float | None = None,
    *,
    data_s: float = 0.0,
    checkpoint_s: float = 0.0,
    samples: int = 0,
) -> None:
    """Report that this worker completed `step` (the rest: see `StepReporter.report`).
    Stateless (open, read, write, close: ~15 us); keep a `StepReporter` instead when calling it
    in a tight loop."""
    path = os.environ.get(ENV_STEP_FILE, "")
    if path:
        previous = read_step_file(path)
        reporter = StepReporter(path)
        if busy_s is not None and previous is not None:
            reporter._busy = previous.busy_s
        if previous is not None and previous.first_step >= 0:
            reporter._first = (previous.first_step, previous.first_at)
        if previous is not None:
            reporter._data, reporter._ckpt = previous.data_s, previous.checkpoint_s
            reporter._samples = previous.samples
        reporter.report(step, busy_s, data_s=data_s, checkpoint_s=checkpoint_s, samples=samples)
        reporter.close()
