"""The job's failure log in its state: what `dlrover diagnose` prints, even after the master
is gone (it reads the state directly then)."""

from __future__ import annotations

import dataclasses
import json

from dlrover.api.master import FailureClass, FailureRecord
from dlrover.master.state_store import StateStore

NAMESPACE = "failures"
MAX_FAILURES = 1000
"""Failures kept per job (the oldest are dropped beyond)."""


def key(seq: int) -> str:
    """The state key of the ``seq``-th failure (sorts in order)."""
    return f"{seq:012d}"


def to_json(record: FailureRecord) -> dict[str, object]:
    """A failure as the JSON document kept in the state."""
    return {**dataclasses.asdict(record), "failure_class": record.failure_class.value}


def load_failures(store: StateStore) -> list[tuple[int, FailureRecord]]:
    """Every kept failure with its sequence number, oldest first."""
    out = []
    for k, raw in sorted(store.items(NAMESPACE).items()):
        doc = json.loads(raw)
        out.append(
            (int(k), FailureRecord(**{**doc, "failure_class": FailureClass(doc["failure_class"])}))
        )
    return out
