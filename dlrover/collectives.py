"""What PyTorch's flight recorder says of a hang, across ranks: the analysis the master, the
agent and `dlrover diagnose` share (no torch here; `dlrover.agent.collectives` takes the
records in the workers).

A rank's summary: per process group (by name), the last collective it entered (``seq``, ``op``,
``state``), and ``stack``, its Python stack's tail; or ``error`` when it did not answer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


def last_per_group(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The flight recorder's entries -> per process group (by name), its last collective."""
    groups: dict[str, dict[str, Any]] = {}
    for entry in entries:
        pg = entry.get("process_group") or [str(entry.get("pg_id", "")), ""]
        name = str(pg[1] or pg[0])
        seq = int(entry.get("collective_seq_id", -1))
        if seq < 0 or (name in groups and groups[name]["seq"] >= seq):
            continue
        groups[name] = {
            "seq": seq,
            "op": str(entry.get("profiling_name", "")),
            "state": str(entry.get("state", "")),
        }
    return groups


def laggards(ranks: Mapping[int, Mapping[str, Any]]) -> list[str]:
    """What the ranks' summaries say of a hang, one line per process group (and one for the
    ranks that did not answer): the ranks whose last collective is behind the others', which
    collective the others wait in; or that every rank entered the same one (the hang is in it)."""
    lines: list[str] = []
    silent = sorted(r for r, doc in ranks.items() if not doc.get("groups") and doc.get("error"))
    names = sorted({g for doc in ranks.values() for g in doc.get("groups", {})})
    for name in names:
        entered = {
            r: doc["groups"][name] for r, doc in ranks.items() if name in doc.get("groups", {})
        }
        top = max(e["seq"] for e in entered.values())
        ahead = sorted(r for r, e in entered.items() if e["seq"] == top)
        behind = sorted(r for r, e in entered.items() if e["seq"] < top)
        op = entered[ahead[0]]["op"]
        group = f"process group {name}"
        if behind:
            last = ", ".join(f"rank {r} at #{entered[r]['seq']}" for r in behind)
            wait = "waits" if len(ahead) == 1 else "wait"
            lines.append(
                f"{_ranks(behind)} did not enter {op} #{top} of {group} that "
                f"{_ranks(ahead)} {wait} in (last entered: {last})"
            )
        else:
            lines.append(
                f"{_ranks(ahead)} entered {op} #{top} of {group}: the hang is inside it "
                "(a rank stopped or slow there, or the network)"
            )
    if silent:
        why = ranks[silent[0]].get("error", "")
        lines.append(f"{_ranks(silent)} did not say: {why}")
    return lines


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def merge(documents: list[str]) -> dict[int, dict[str, Any]]:
    """Several nodes' hang reports (`FailureRecord.collectives`, JSON) -> rank -> summary."""
    ranks: dict[int, dict[str, Any]] = {}
    for document in documents:
        if not document:
            continue
        try:
            doc = json.loads(document)
        except json.JSONDecodeError:
            continue
        for rank, summary in doc.items():
            if str(rank).lstrip("-").isdigit() and isinstance(summary, dict):
                ranks[int(rank)] = summary
    return ranks


def behind(ranks: Mapping[int, Mapping[str, Any]]) -> list[int]:
    """The ranks the others wait for: behind in some process group, or silent."""
    out: set[int] = set()
    names = {g for doc in ranks.values() for g in doc.get("groups", {})}
    for name in names:
        seqs = {r: doc["groups"][name]["seq"] for r, doc in ranks.items() if name in doc["groups"]}
        top = max(seqs.values())
        out.update(r for r, seq in seqs.items() if seq < top)
    out.update(r for r, doc in ranks.items() if not doc.get("groups") and doc.get("error"))
    return sorted(out)
