"""The job's failure log in its state: what `dlrover diagnose` prints, even after the master
is gone (it reads the state directly then)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

from dlrover.api.master import FailureClass, FailureRecord
from dlrover.master.state_store import StateStore

NAMESPACE = "failures"
FOLDS_NAMESPACE = "failure_folds"
MAX_FAILURES = 1000
"""Failures kept one by one per job; older ones live on folded (`Fold`)."""
MAX_FOLDS = 1000
"""Folds kept of the failures older than the last MAX_FAILURES (the least recent dropped)."""
MAX_CAUSE_CHARS = 8192
"""A root cause is kept up to this long: its head and its tail (where a traceback names the
error), the middle left out and said so."""
HEAD_CHARS = 2048
FOLD_AT = 10
"""A failure repeated this often (numbers aside) in one round is answered as one record, with
its count; rarer ones are answered one by one."""

_DIGITS = str.maketrans("", "", "0123456789")


def bounded_cause(text: str) -> str:
    """``text`` if it is at most MAX_CAUSE_CHARS long, else its head and tail with a line that
    says how much was left out between them."""
    if len(text) <= MAX_CAUSE_CHARS:
        return text
    tail = MAX_CAUSE_CHARS - HEAD_CHARS
    left_out = len(text) - HEAD_CHARS - tail
    return f"{text[:HEAD_CHARS]}\n... {left_out} characters left out ...\n{text[-tail:]}"


def cause_print(cause: str) -> str:
    """The identity of a root cause for folding: a hash of its whole text (before it is
    bounded) without its digits, as a rank, a pid, an address or a host differ from node to
    node in the same failure (0.2 ms for 64 KB)."""
    return hashlib.blake2b(cause.translate(_DIGITS).encode(), digest_size=12).hexdigest()


FoldKey = tuple[str, str, int, str]
"""(class, action, round, cause print): failures that fold into one line."""


def fold_key(record: FailureRecord, print_: str) -> FoldKey:
    """The fold ``record`` (whose root cause prints as ``print_``) belongs to."""
    return (record.failure_class.value, record.action, record.round, print_)


@dataclasses.dataclass
class Fold:
    """Failures of one fold key: the newest one as the record, how many, the first's time, and
    the nodes they came from."""

    record: FailureRecord
    count: int
    first_at: float
    nodes: set[str]

    def add(self, record: FailureRecord) -> None:
        """Count ``record`` (itself possibly a fold) in."""
        self.count += max(1, record.count)
        self.first_at = min(self.first_at, record.first_at or record.at)
        self.nodes.add(record.node_id)
        if record.at >= self.record.at:
            self.record = record

    def merge(self, other: Fold) -> None:
        """Count ``other``'s failures in (a fold of the same key); the newer record stays."""
        self.count += other.count
        self.first_at = min(self.first_at, other.first_at)
        self.nodes |= other.nodes
        if other.record.at >= self.record.at:
            self.record = other.record

    def folded(self) -> FailureRecord:
        """The fold as one record (`dlrover diagnose`'s line): the newest failure's fields,
        with the count, the first's time and the number of nodes (one failure: as it is)."""
        if self.count == 1:
            return self.record
        return dataclasses.replace(
            self.record, count=self.count, first_at=self.first_at, node_count=len(self.nodes)
        )


def fold(records: list[tuple[FailureRecord, str]]) -> dict[FoldKey, Fold]:
    """``(record, cause print)`` pairs folded by `fold_key`, in order of first occurrence."""
    out: dict[FoldKey, Fold] = {}
    for record, print_ in records:
        k = fold_key(record, print_)
        if k in out:
            out[k].add(record)
        else:
            out[k] = Fold(
                record, max(1, record.count), record.first_at or record.at, {record.node_id}
            )
    return out


def key(seq: int) -> str:
    """The state key of the ``seq``-th failure (sorts in order)."""
    return f"{seq:012d}"


def to_json(record: FailureRecord) -> dict[str, object]:
    """A failure as the JSON document kept in the state."""
    return {**dataclasses.asdict(record), "failure_class": record.failure_class.value}


def kept_to_json(record: FailureRecord, print_: str) -> dict[str, object]:
    """A kept failure as the state holds it: with its cause print (`cause_print` of the cause
    as reported, which a bounded cause no longer gives)."""
    return {**to_json(record), "print": print_}


def load_kept(store: StateStore) -> list[tuple[int, FailureRecord, str]]:
    """Every kept failure with its sequence number and cause print, oldest first."""
    out = []
    for k, raw in sorted(store.items(NAMESPACE).items()):
        doc = json.loads(raw)
        print_ = str(doc.pop("print", "")) or cause_print(str(doc["root_cause"]))
        record = FailureRecord(**{**doc, "failure_class": FailureClass(doc["failure_class"])})
        out.append((int(k), record, print_))
    return out


def load_failures(store: StateStore) -> list[tuple[int, FailureRecord]]:
    """Every kept failure with its sequence number, oldest first."""
    return [(seq, record) for seq, record, _ in load_kept(store)]


def fold_to_json(k: FoldKey, f: Fold) -> dict[str, object]:
    """A fold of dropped failures as kept in the state."""
    return {**to_json(f.folded()), "print": k[3]}


def load_folds(store: StateStore) -> dict[FoldKey, Fold]:
    """The folds of the failures older than the kept ones (their node sets: the count only,
    as numbered placeholders)."""
    out: dict[FoldKey, Fold] = {}
    for raw in store.items(FOLDS_NAMESPACE).values():
        doc = json.loads(raw)
        print_ = str(doc.pop("print"))
        record = FailureRecord(**{**doc, "failure_class": FailureClass(doc["failure_class"])})
        nodes = {f"#{i}" for i in range(record.node_count)}
        out[fold_key(record, print_)] = Fold(record, record.count, record.first_at, nodes)
    return out


def fold_state_key(k: FoldKey) -> str:
    """The state key of fold ``k``."""
    return f"{k[0]}|{k[1]}|{k[2]}|{k[3]}"


def folded(
    older: dict[FoldKey, Fold], kept: list[tuple[FailureRecord, str]]
) -> tuple[FailureRecord, ...]:
    """Every failure, oldest first: the kept ones (``(record, cause print)``) one by one, except
    that a failure repeated FOLD_AT times or more (numbers aside, in one round) is one record,
    as are the folds of the dropped ones (``older``) with any kept ones of theirs counted in."""
    members: dict[FoldKey, list[tuple[int, FailureRecord]]] = {}
    for index, (record, print_) in enumerate(kept):
        members.setdefault(fold_key(record, print_), []).append((index, record))
    out: list[tuple[tuple[int, float], FailureRecord]] = []
    groups = {k: Fold(f.record, f.count, f.first_at, set(f.nodes)) for k, f in older.items()}
    for k, records in members.items():
        if k not in groups and len(records) < FOLD_AT:
            out.extend(((1, index), record) for index, record in records)
            continue
        for _, record in records:
            if k in groups:
                groups[k].add(record)
            else:
                groups[k] = fold([(record, k[3])])[k]
    for k, group in groups.items():
        # Folds of dropped failures are older than every kept one; the others sit where
        # their first failure does.
        where = (1, members[k][0][0]) if k not in older else (0, group.first_at)
        out.append((where, group.folded()))
    out.sort(key=lambda item: item[0])
    return tuple(record for _, record in out)


def load_folded(store: StateStore) -> tuple[FailureRecord, ...]:
    """What a master of this state would answer `DiagnosticsApi.get_failures` (`dlrover
    diagnose` of an ended job)."""
    kept = [(record, print_) for _, record, print_ in load_kept(store)]
    return folded(load_folds(store), kept)
