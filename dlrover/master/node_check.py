"""The pre-flight node check's master side: pairing, localising a faulty node, naming stragglers.

Once a rendezvous round closes, the agents started with ``--node-check`` check their nodes
before training: in check round 1 the members are paired in node-rank order, (0, 1), (2, 3), ...
(an odd last node runs alone); each group runs a short compute test (matmul) and a collective
test (allreduce over gloo, NCCL on GPUs) and reports its times or its error. A group that fails
makes its members suspects. Check round 2 pairs every suspect, and a node that ran alone, with a
node of a group that passed, so a single faulty node is named after at most 2 rounds. The faulty
nodes are the fewest that explain every failed group (a node in a passed group is healthy); a
straggler is a node whose compute time is more than ``straggler_ratio`` times the median of the
others'. The verdict excludes faulty nodes, and stragglers when asked to: their agents exit, the
engine relaunches them, and the other members form the world again.

Everything here is pure bookkeeping on the master's clock; `JobMaster` owns one `NodeCheck` per
rendezvous round, and the agents drive it with JoinNodeCheck / ReportNodeCheck.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from dlrover.api.master import NodeCheckState as TaskState
from dlrover.api.master import NodeCheckTask as CheckTask

DEFAULT_STRAGGLER_RATIO = 2.0
"""A node whose check compute time exceeds this multiple of the others' median is a straggler."""
DEFAULT_CHECK_ROUND_TIMEOUT_S = 60.0
"""How long one check round may take, from its first join to its last report; a node that has
not joined or reported by then counts as failed ("did not answer")."""
MAX_CHECK_ROUNDS = 2


@dataclass(frozen=True)
class CheckSettings:
    """How a check judges; the first agent that joins a round's check sets them."""

    straggler_ratio: float = DEFAULT_STRAGGLER_RATIO
    exclude_stragglers: bool = False
    round_timeout_s: float = DEFAULT_CHECK_ROUND_TIMEOUT_S
    max_rounds: int = MAX_CHECK_ROUNDS


@dataclass(frozen=True)
class CheckResult:
    """One node's result of one check round."""

    ok: bool
    compute_s: float = 0.0
    comm_s: float = 0.0
    error: str = ""


@dataclass(frozen=True)
class Verdict:
    """The outcome of a whole check."""

    faulty: dict[str, str]
    """node id -> why it is faulty."""
    stragglers: dict[str, float]
    """node id -> its compute time over the median of the others'."""
    excluded: tuple[str, ...]
    times: dict[str, float]
    """node id -> round-1 compute seconds."""
    rounds: int
    elapsed_s: float
    summary: str


Group = tuple[str, ...]


def first_groups(members: Sequence[str]) -> list[Group]:
    """Check round 1: pairs in node-rank order; an odd last node alone."""
    groups = [tuple(members[i : i + 2]) for i in range(0, len(members) - 1, 2)]
    if len(members) % 2:
        groups.append((members[-1],))
    return groups


def next_groups(
    history: Sequence[Sequence[tuple[Group, bool]]], members: Sequence[str]
) -> list[Group]:
    """The next check round: every suspect (a member of a failed group not proven healthy) and
    every node never checked with a partner gets a healthy partner, one each, while there are
    healthy nodes; the rest pair up with nodes they were not grouped with before. Empty when
    nothing would be learnt."""
    good = healthy(history)
    together = {frozenset(g) for rnd in history for g, _ in rnd}
    partnered = {n for rnd in history for g, _ in rnd if len(g) > 1 for n in g}
    suspects = [
        n for n in members if n not in good and (_in_failed(n, history) or n not in partnered)
    ]
    spare = [n for n in members if n in good]
    groups: list[Group] = []
    left: list[str] = []
    for node in suspects:
        if spare:
            groups.append((spare.pop(0), node))
        else:
            left.append(node)
    while left:
        node = left.pop(0)
        mate = next((m for m in left if frozenset((node, m)) not in together), None)
        if mate is not None:
            left.remove(mate)
            groups.append((node, mate))
    return groups


def _in_failed(node: str, history: Sequence[Sequence[tuple[Group, bool]]]) -> bool:
    return any(node in g and not ok for rnd in history for g, ok in rnd)


def healthy(history: Sequence[Sequence[tuple[Group, bool]]]) -> set[str]:
    """Nodes of a group of two or more that passed."""
    return {n for rnd in history for g, ok in rnd if ok and len(g) > 1 for n in g}


def localise(history: Sequence[Sequence[tuple[Group, bool]]]) -> set[str]:
    """The fewest nodes that explain every failed group (a failed group holds at least one faulty
    node; a passed one none). Where the groups cannot tell two suspects apart, both are named."""
    good = healthy(history)
    remaining = [set(g) - good for rnd in history for g, ok in rnd if not ok]
    remaining = [c for c in remaining if c]
    faulty: set[str] = set()
    while remaining:
        sure = {next(iter(c)) for c in remaining if len(c) == 1}
        if sure:
            chosen = sure
        else:
            counts: dict[str, int] = {}
            for c in remaining:
                for n in c:
                    counts[n] = counts.get(n, 0) + 1
            top = max(counts.values())
            chosen = {n for n, k in counts.items() if k == top}
        faulty |= chosen
        remaining = [c for c in remaining if not c & faulty]
    return faulty


def stragglers(times: dict[str, float], ratio: float) -> dict[str, float]:
    """Nodes slower than ``ratio`` times the median of the other nodes' times, with their
    factor."""
    slow: dict[str, float] = {}
    for node, t in times.items():
        others = [v for n, v in times.items() if n != node]
        if not others:
            continue
        median = statistics.median(others)
        if median > 0 and t > ratio * median:
            slow[node] = t / median
    return slow


@dataclass
class _Round:
    number: int
    started_at: float
    addrs: dict[str, str] = field(default_factory=dict)
    groups: list[Group] | None = None
    results: dict[str, CheckResult] = field(default_factory=dict)
    absent: list[str] = field(default_factory=list)
    """Members that did not join the round in time."""
    done: bool = False


class NodeCheck:
    """The check of one rendezvous round's members (ordered by node rank)."""

    def __init__(
        self,
        rdzv_round: int,
        members: Sequence[str],
        settings: CheckSettings,
        clock: Callable[[], float],
        already_checked: Iterable[str] = (),
    ) -> None:
        self.rdzv_round = rdzv_round
        self.members = list(members)
        self.settings = settings
        self._clock = clock
        self._started = clock()
        self._rounds: dict[int, _Round] = {}
        self._history: list[list[tuple[Group, bool]]] = []
        self._times: dict[str, float] = {}
        self._gone: set[str] = set()
        """Members that missed a round: faulty, and not waited for again."""
        self.verdict: Verdict | None = None
        self.aborted = ""
        self.applied = False
        """Set by the owner once it acted on the verdict."""
        self.version = 0
        """Bumped when a round is paired, the verdict is out or the check is abandoned: what
        the joins waiting for their task must wake up for."""
        if set(self.members) <= set(already_checked):
            self._decide(rounds=0)  # nobody new: nothing to check

    # --- the agents' calls -------------------------------------------------------------------
    def join(self, node_id: str, check_round: int, addr: str) -> None:
        """Record that ``node_id`` is ready for ``check_round`` at ``addr`` (host:port)."""
        if node_id not in self.members or self.verdict is not None or self.aborted:
            return
        if not 1 <= check_round <= self.settings.max_rounds:
            return
        if check_round > 1 and check_round - 1 not in self._rounds:
            return  # a join from a check this master never ran: the task says REFORM
        rnd = self._rounds.setdefault(check_round, _Round(check_round, self._clock()))
        if rnd.groups is None:
            rnd.addrs[node_id] = addr
            self._maybe_pair(rnd)

    def report(self, node_id: str, check_round: int, result: CheckResult) -> None:
        """Record ``node_id``'s result of ``check_round``."""
        rnd = self._rounds.get(check_round)
        if rnd is None or rnd.done or rnd.groups is None or self.verdict is not None:
            return
        rnd.results.setdefault(node_id, result)
        grouped = {n for g in rnd.groups for n in g}
        if grouped <= set(rnd.results):
            self._finish(rnd)

    def task(self, node_id: str, check_round: int) -> CheckTask | None:
        """What ``node_id`` joining ``check_round`` must do now; None: wait."""
        if self.aborted:
            return CheckTask(TaskState.REFORM, check_round, summary=self.aborted)
        if node_id not in self.members:
            return CheckTask(TaskState.REFORM, check_round, summary="not a member of this round")
        if self.verdict is not None:
            v = self.verdict
            if node_id in v.excluded:
                why = v.faulty.get(node_id) or (
                    f"straggler: {v.stragglers[node_id]:.1f}x the median check time"
                )
                return CheckTask(
                    TaskState.DONE, check_round, excluded=True, reason=why, summary=v.summary
                )
            state = TaskState.REFORM if v.excluded else TaskState.DONE
            return CheckTask(state, check_round, summary=v.summary)
        if check_round > 1 and check_round - 1 not in self._rounds:
            # A check this master did not run (it restarted mid-check): start over.
            return CheckTask(
                TaskState.REFORM, check_round, summary="the master lost this check; join again"
            )
        rnd = self._rounds.get(check_round)
        if rnd is None or rnd.groups is None:
            return None
        for group in rnd.groups:
            if node_id in group:
                return CheckTask(
                    TaskState.RUN,
                    check_round,
                    tuple(rnd.addrs[n] for n in group),
                    group.index(node_id),
                )
        return CheckTask(TaskState.RUN, check_round)  # sits this round out

    # --- time ----------------------------------------------------------------------------------
    def deadline(self) -> float | None:
        """When the current check round times out (master clock); None when nothing waits."""
        rnd = self._current()
        if self.verdict is not None or self.aborted or rnd is None:
            return None
        return rnd.started_at + self.settings.round_timeout_s

    def tick(self) -> bool:
        """Time out the current round if its deadline passed; True if that changed anything."""
        deadline = self.deadline()
        if deadline is None or self._clock() < deadline:
            return False
        rnd = self._current()
        assert rnd is not None
        if rnd.groups is None:
            missing = [n for n in self._present() if n not in rnd.addrs]
            # Who never came is faulty; the others are checked among themselves.
            for node in missing:
                rnd.addrs[node] = ""
            self._pair(rnd, absent=missing)
            return True
        for group in rnd.groups:
            for node in group:
                rnd.results.setdefault(
                    node,
                    CheckResult(
                        False, error=f"no result within {self.settings.round_timeout_s:.0f}s"
                    ),
                )
        self._finish(rnd)
        return True

    def abort(self, why: str) -> None:
        """The world changed under the check (a member was lost, the job ended): every member
        joins again."""
        if self.verdict is None and not self.aborted:
            self.aborted = f"node check of round {self.rdzv_round} abandoned: {why}"
            self.version += 1

    # --- internals -----------------------------------------------------------------------------
    def _current(self) -> _Round | None:
        """The first check round not done (rounds are done in order)."""
        return next((r for k, r in sorted(self._rounds.items()) if not r.done), None)

    def _present(self) -> list[str]:
        return [n for n in self.members if n not in self._gone]

    def _maybe_pair(self, rnd: _Round) -> None:
        """Pair ``rnd`` once the round before it is done and every member joined it."""
        previous_done = rnd.number == 1 or self._rounds[rnd.number - 1].done
        if rnd.groups is None and previous_done and set(self._present()) <= set(rnd.addrs):
            self._pair(rnd)

    def _pair(self, rnd: _Round, absent: Sequence[str] = ()) -> None:
        rnd.started_at = self._clock()  # the groups get the whole time-out to run
        self.version += 1
        rnd.absent = list(absent)
        self._gone.update(absent)
        present = self._present()
        if rnd.number == 1:
            rnd.groups = first_groups(present)
        else:
            rnd.groups = next_groups(self._history, present)
        if not rnd.groups:
            self._finish(rnd)

    def _finish(self, rnd: _Round) -> None:
        rnd.done = True
        assert rnd.groups is not None
        outcome = [(g, all(rnd.results[n].ok for n in g)) for g in rnd.groups]
        for node in rnd.absent:
            outcome.append(((node,), False))
        self._history.append(outcome)
        if rnd.number == 1:
            self._times = {n: r.compute_s for n, r in rnd.results.items() if r.ok}
        more = rnd.number < self.settings.max_rounds and any(
            not ok or len(g) == 1 for g, ok in outcome
        )
        if more and next_groups(self._history, self._present()):
            # The next round's clock starts now; the agents may have joined it already.
            nxt = self._rounds.setdefault(rnd.number + 1, _Round(rnd.number + 1, self._clock()))
            nxt.started_at = self._clock()
            self._maybe_pair(nxt)
            return
        self._decide(rnd.number)

    def _decide(self, rounds: int) -> None:
        errors: dict[str, str] = {}
        for rnd in self._rounds.values():
            for node, result in rnd.results.items():
                if not result.ok and result.error:
                    errors.setdefault(node, result.error)
            for node in rnd.absent:
                errors.setdefault(
                    node,
                    f"did not join check round {rnd.number} within "
                    f"{self.settings.round_timeout_s:.0f}s",
                )
        faulty = {
            n: f"failed the node check: {errors.get(n, 'its groups failed')}"
            for n in sorted(localise(self._history))
        }
        slow = stragglers(self._times, self.settings.straggler_ratio)
        excluded = set(faulty) | (set(slow) if self.settings.exclude_stragglers else set())
        elapsed = self._clock() - self._started
        parts = [
            f"node check of round {self.rdzv_round}: {len(self.members)} nodes, "
            f"{rounds} check round(s), {elapsed:.1f}s"
        ]
        if rounds == 0:
            parts = [f"node check of round {self.rdzv_round}: every node was checked before"]
        if faulty:
            parts.append("faulty: " + ", ".join(f"{n} ({w})" for n, w in faulty.items()))
        if slow:
            parts.append("stragglers: " + ", ".join(f"{n} ({f:.1f}x)" for n, f in slow.items()))
        if excluded:
            parts.append("excluded: " + ", ".join(sorted(excluded)))
        elif rounds:
            parts.append("all healthy" if not slow else "none excluded")
        self.version += 1
        self.verdict = Verdict(
            faulty=faulty,
            stragglers=slow,
            excluded=tuple(sorted(excluded)),
            times=dict(self._times),
            rounds=rounds,
            elapsed_s=elapsed,
            summary="; ".join(parts),
        )
