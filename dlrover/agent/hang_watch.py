"""Which workers of a node hang: each worker's phase, its timeout (learned or given), and the
evidence of its stacks. Pure: the monitor feeds it records, stacks and CPU times.

A worker is in one phase at a time (`dlrover.hang_spec`): ``startup`` until its first step or
optimizer step of the attempt, ``step`` from the latest one, or the section it marked. Progress
is a new step, a new optimizer step (a beat) or a change of section; the phase's age is the time
since. Every phase's durations teach its timeout (`PhaseHistory`).

- A **fixed** timeout (the user's ``--hang-timeout S`` or ``PHASE=S``) is obeyed as is: a worker
  past it is hung.
- A **learned** timeout is confirmed by evidence. From a quarter of it on, the monitor samples
  the worker's stack and CPU time every eighth of it (at least every MIN_SAMPLE_EVERY_S); the
  worker is hung once it is past the timeout and its main thread's stack (its functions,
  innermost first) has not changed for half the timeout. A worker whose stack keeps changing is
  working (an evaluation, a compile, a save nobody marked) and is never called hung. A worker
  whose stack stands still while it keeps a core busy is either spinning in a loop that never
  ends or computing in one long call (an unmarked evaluation whose loop is one line of tensor
  calls looks the same from outside): it is hung only past BUSY_FLOOR_FACTOR times the phase's
  floor (5 minutes for steps at the defaults), so a long computation gets that long.
- A worker whose unchanged stack waits in a collective (innermost frame in torch.distributed,
  DDP, or a backward using no CPU) waits for another rank; that rank's own agent judges it. It is
  hung itself only when every rank of the job is on this node and waits too (a deadlock), when a
  rank of this node has already exited, or past the phase's cap.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dlrover.hang_spec import STARTUP, STEP, HangSpec, PhaseHistory, defaults_of
from dlrover.trainer.progress import SectionRecord, StepRecord

MIN_SAMPLE_EVERY_S = 1.0
BUSY_CPU_SHARE = 0.2
"""A worker (with its children) that used at least this share of a core while its stack stood
still is busy: spinning, or computing in one long call."""
BUSY_FLOOR_FACTOR = 5.0
"""A busy worker with a still stack is hung only past this many times its phase's floor."""
WAITING_CPU_SHARE = 0.05
"""A backward whose process used under this share of a core between two samples waits for its
all-reduce (a computing one uses a core)."""
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line \d+ in (?P<func>\S+)')
_WAIT_FILES = ("/torch/distributed/", "/torch/nn/parallel/distributed.py")
_BACKWARD_FILES = ("/torch/autograd/", "/torch/_tensor.py")


def stack_signature(main_stack: str) -> tuple[str, ...]:
    """A faulthandler dump's main thread as ``file:function`` frames, innermost first (lines are
    left out: a loop that waits moves between lines of the same functions). No frames (a
    process that did not answer): the dump's text."""
    frames = tuple(f"{m['file']}:{m['func']}" for m in _FRAME.finditer(main_stack))
    return frames or (main_stack.strip()[:200],)


def waits_in_collective(signature: tuple[str, ...], cpu_share: float | None) -> bool:
    """Whether the innermost frame is a wait for other ranks."""
    if not signature:
        return False
    inner = signature[0]
    if any(part in inner for part in _WAIT_FILES):
        return True
    return (
        any(part in inner for part in _BACKWARD_FILES)
        and cpu_share is not None
        and cpu_share < WAITING_CPU_SHARE
    )


@dataclass
class _Rank:
    phase: str = STARTUP
    since: float = 0.0
    """When the current phase began (its age counts from here)."""
    record: StepRecord | None = None
    sections: SectionRecord | None = None
    progressed: bool = False
    """A step or an optimizer step was seen in this attempt (the phase is no longer startup)."""
    reports_steps: bool = False
    progress_at: float = 0.0
    section_end: float = 0.0
    # evidence, while the phase is old
    signature: tuple[str, ...] | None = None
    constant_since: float = 0.0
    constant_cpu: float | None = None
    """CPU seconds when the stack stopped changing (None: unknown)."""
    next_sample: float = 0.0
    cpu: tuple[float, float] | None = None
    """(CPU seconds, when) of the last sample."""
    waiting: bool = False
    witnessed: bool = False
    """This stall's wait in a collective was reported to the master (once per stall)."""


@dataclass(frozen=True)
class Due:
    """A worker whose phase is old: sample its stack (``sample``), or hung now (a fixed timeout
    passed: ``fixed``)."""

    local_rank: int
    phase: str
    age_s: float
    timeout_s: float
    fixed: bool


@dataclass(frozen=True)
class Hang:
    """A worker found hung, and why (one line for the log and the failure record)."""

    local_rank: int
    phase: str
    reason: str


class HangWatch:
    """Phases, learned timeouts and stack evidence of one attempt's workers."""

    def __init__(
        self, spec: HangSpec, history: PhaseHistory, num_workers: int, started_at: float
    ) -> None:
        self._spec = spec
        self.history = history
        self._started_at = started_at
        self._ranks = [_Rank(since=started_at) for _ in range(num_workers)]

    # --- progress --------------------------------------------------------------------------
    def observe(
        self,
        local_rank: int,
        record: StepRecord | None,
        sections: SectionRecord | None,
        now: float,
    ) -> None:
        """Feed a worker's step file: its step record and its section and beat record."""
        rank = self._ranks[local_rank]
        start = self._started_at
        progress_at = None
        old = rank.sections
        if sections is not None and sections != old:
            rank.sections = sections
            if (
                sections.last
                and sections.last_end >= start
                and (old is None or (old.last, old.last_end) != (sections.last, sections.last_end))
            ):
                self.history.add(sections.last, sections.last_s)
                rank.section_end = max(rank.section_end, sections.last_end)
        if record is not None and record != rank.record and record.at >= start:
            previous = rank.record if rank.record is not None and rank.record.at >= start else None
            rank.record = record
            rank.reports_steps = True
            if previous is None:
                known = record.first_step >= 0 and record.first_at >= start
                self._first_progress(rank, record.first_at if known else record.at)
            elif record.step > previous.step and rank.section_end <= previous.at:
                n = record.step - previous.step
                self.history.add(STEP, (record.at - previous.at) / n, n)
            progress_at = record.at
        if (
            sections is not None
            and sections.beats
            and sections.beat_at >= start
            and (old is None or old.beats != sections.beats)
        ):
            if not rank.progressed:
                self._first_progress(rank, sections.beat_at)
            elif (
                not rank.reports_steps
                and old is not None
                and old.beats < sections.beats
                and old.beat_at >= start
                and rank.section_end <= old.beat_at
            ):
                n = sections.beats - old.beats
                self.history.add(STEP, (sections.beat_at - old.beat_at) / n, n)
            progress_at = max(progress_at or 0.0, sections.beat_at)
        if progress_at is not None:
            rank.progressed = True
            rank.progress_at = max(rank.progress_at, min(progress_at, now))
        self._set_phase(rank)

    def _first_progress(self, rank: _Rank, at: float) -> None:
        if not rank.progressed:
            self.history.add(STARTUP, max(0.0, at - self._started_at))
            rank.progressed = True

    def _set_phase(self, rank: _Rank) -> None:
        s = rank.sections
        if s is not None and s.name and s.since >= self._started_at:
            phase, since = s.name, s.since
        elif rank.progressed:
            phase, since = STEP, max(rank.progress_at, rank.section_end)
        else:
            phase, since = STARTUP, self._started_at
        if (phase, since) != (rank.phase, rank.since):
            rank.phase, rank.since = phase, since
            rank.signature, rank.next_sample, rank.waiting = None, 0.0, False
            rank.witnessed = False

    # --- judging -----------------------------------------------------------------------------
    def timeout(self, local_rank: int) -> tuple[str, float, bool]:
        """(phase, timeout seconds, learned) of a worker now."""
        phase = self._ranks[local_rank].phase
        seconds, learned = self._spec.timeout(phase, self.history)
        return phase, seconds, learned

    def due(self, now: float, finished: set[int]) -> list[Due]:
        """Workers to sample now, or hung past a fixed timeout."""
        out = []
        for local_rank, rank in enumerate(self._ranks):
            if local_rank in finished:
                continue
            phase, timeout, learned = self.timeout(local_rank)
            if timeout <= 0:
                continue
            age = now - rank.since
            if not learned:
                if age > timeout:
                    out.append(Due(local_rank, phase, age, timeout, fixed=True))
            elif age >= timeout / 4 and now >= rank.next_sample:
                out.append(Due(local_rank, phase, age, timeout, fixed=False))
        return out

    def sample(self, local_rank: int, main_stack: str, cpu_s: float | None, now: float) -> None:
        """A worker's main-thread stack and CPU seconds, taken now."""
        rank = self._ranks[local_rank]
        _, timeout, _ = self.timeout(local_rank)
        signature = stack_signature(main_stack)
        share = None
        if cpu_s is not None and rank.cpu is not None and now > rank.cpu[1]:
            share = (cpu_s - rank.cpu[0]) / (now - rank.cpu[1])
        if cpu_s is not None:
            rank.cpu = (cpu_s, now)
        if signature != rank.signature:
            rank.signature, rank.constant_since, rank.constant_cpu = signature, now, cpu_s
        rank.waiting = waits_in_collective(signature, share)
        rank.next_sample = now + max(MIN_SAMPLE_EVERY_S, timeout / 8)

    def hung(self, now: float, finished: set[int], whole_world_here: bool) -> list[Hang]:
        """Workers hung by the evidence (learned timeouts; fixed ones come from `due`)."""
        stuck: list[Hang] = []
        waiting: list[tuple[int, str, str, str | None]] = []
        confirmed_waiting = 0
        active = [lr for lr in range(len(self._ranks)) if lr not in finished]
        for local_rank in active:
            rank = self._ranks[local_rank]
            phase, timeout, learned = self.timeout(local_rank)
            if not learned or timeout <= 0 or rank.signature is None:
                continue
            age = now - rank.since
            still = now - rank.constant_since
            if age < timeout or still < timeout / 2:
                continue
            where = rank.signature[0].rsplit("/", 1)[-1]
            how = self._how(phase, timeout)
            busy = self._busy_share(rank, now)
            if busy is not None and not rank.waiting:
                bound = max(timeout, BUSY_FLOOR_FACTOR * self._spec.floor_of(phase))
                if age < bound:
                    continue  # spinning, or one long computation: it gets longer
                how = f"{how}; busy at {busy:.0%} of a core, bound {bound:.0f}s"
            if not rank.waiting:
                stuck.append(
                    Hang(
                        local_rank,
                        phase,
                        f"{age:.0f}s in {phase} ({how}); its stack has not "
                        f"changed for {still:.0f}s, at {where}",
                    )  # fmt: skip
                )
                continue
            confirmed_waiting += 1
            cap = max(timeout, defaults_of(phase).cap)
            if finished:
                why: str | None = "a rank of this node has exited"
            elif age >= cap:
                why = f"past the cap {cap:.0f}s"
            else:
                why = None  # hung only as part of a deadlock (below)
            waiting.append((local_rank, phase, f"{age:.0f}s in {phase} waiting in a collective "
                            f"at {where} ({how})", why))  # fmt: skip
        if stuck:
            return stuck
        deadlock = bool(waiting) and whole_world_here and confirmed_waiting == len(active)
        return [
            Hang(lr, phase, f"{what}; {why or 'every rank of the job waits: a deadlock'}")
            for lr, phase, what, why in waiting
            if why is not None or deadlock
        ]

    @staticmethod
    def _busy_share(rank: _Rank, now: float) -> float | None:
        """The share of a core the worker used while its stack stood still, if busy."""
        if rank.constant_cpu is None or rank.cpu is None or now <= rank.constant_since:
            return None
        share = (rank.cpu[0] - rank.constant_cpu) / max(1e-9, rank.cpu[1] - rank.constant_since)
        return share if share >= BUSY_CPU_SHARE else None

    def witnesses(self, now: float, finished: set[int], whole_world_here: bool) -> list[Hang]:
        """Workers found waiting in a collective past their timeout while every running worker
        of this node waits (not hung themselves: the rank they wait for is another node's,
        judged by its own agent), each once per stall: what they wait in tells the master which
        rank holds the others. None when the whole job is on this node (its own verdicts say
        it) or a worker here is still working (the one the others may wait for)."""
        active = [lr for lr in range(len(self._ranks)) if lr not in finished]
        if whole_world_here or not all(self._ranks[lr].waiting for lr in active):
            return []
        out = []
        for local_rank, rank in enumerate(self._ranks):
            if local_rank in finished or rank.witnessed or not rank.waiting:
                continue
            phase, timeout, learned = self.timeout(local_rank)
            age = now - rank.since
            if not learned or timeout <= 0 or age < timeout:
                continue
            if now - rank.constant_since < timeout / 2:
                continue
            rank.witnessed = True
            where = rank.signature[0].rsplit("/", 1)[-1] if rank.signature else "?"
            out.append(
                Hang(
                    local_rank,
                    phase,
                    f"{age:.0f}s in {phase} waiting in a collective at {where} "
                    "for a rank of another node",
                )  # fmt: skip
            )
        return out

    def _how(self, phase: str, timeout: float) -> str:
        p99 = self.history.p99(phase)
        n = self.history.count(phase)
        if p99 is None or n < defaults_of(phase).min_samples:
            return f"timeout {timeout:.0f}s, the default before its history"
        return f"timeout {timeout:.0f}s learned from {n} durations, p99 {p99:.2f}s"

    def phase_of(self, local_rank: int, now: float) -> tuple[str, float]:
        """(phase, its age) of a worker."""
        rank = self._ranks[local_rank]
        return rank.phase, now - rank.since
