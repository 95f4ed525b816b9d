"""Training progress reporting: the step each worker has completed, for hang detection and status."""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from typing import NamedTuple

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
