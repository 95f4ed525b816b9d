"""What the flight recorder says of a hang across ranks (`dlrover.collectives`), and the
summary a worker writes when its agent asks (`dlrover.agent.collectives`)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from dlrover.agent import collectives as worker_side
from dlrover.collectives import behind, laggards, last_per_group, merge


def _entry(seq: int, op: str = "gloo:all_reduce", pg: str = "default_pg") -> dict[str, object]:
    return {"collective_seq_id": seq, "profiling_name": op, "state": "scheduled",
            "process_group": ["0", pg], "pg_id": 0}  # fmt: skip


def test_the_last_collective_of_each_group() -> None:
    entries = [_entry(3), _entry(4, "gloo:broadcast"), _entry(1, pg="tp"), _entry(2, pg="tp")]
    assert last_per_group(entries) == {
        "default_pg": {"seq": 4, "op": "gloo:broadcast", "state": "scheduled"},
        "tp": {"seq": 2, "op": "gloo:all_reduce", "state": "scheduled"},
    }


def test_the_rank_behind_is_named_with_the_collective_the_others_wait_in() -> None:
    ranks = {
        0: {"groups": {"default_pg": {"seq": 9, "op": "gloo:all_reduce"}}},
        1: {"groups": {"default_pg": {"seq": 8, "op": "gloo:all_reduce"}}},
        2: {"groups": {"default_pg": {"seq": 9, "op": "gloo:all_reduce"}}},
    }
    assert laggards(ranks) == [
        "rank 1 did not enter gloo:all_reduce #9 of process group default_pg that ranks 0, 2 "
        "wait in (last entered: rank 1 at #8)"
    ]
    assert behind(ranks) == [1]


def test_every_rank_in_the_same_collective_and_a_silent_rank() -> None:
    ranks = {
        0: {"groups": {"default_pg": {"seq": 9, "op": "gloo:all_reduce"}}},
        1: {"groups": {"default_pg": {"seq": 9, "op": "gloo:all_reduce"}}},
        2: {"groups": {}, "error": "no answer within 2s (stopped, or holding the GIL)"},
    }
    lines = laggards(ranks)
    assert lines[0].startswith("ranks 0, 1 entered gloo:all_reduce #9 of process group default_pg")
    assert lines[1] == "rank 2 did not say: no answer within 2s (stopped, or holding the GIL)"
    assert behind(ranks) == [2]  # a SIGSTOPped rank answers nothing: the one to look at


def test_nodes_reports_merge_by_rank() -> None:
    a = json.dumps({"0": {"groups": {"g": {"seq": 2, "op": "x"}}}})
    b = json.dumps({"1": {"groups": {"g": {"seq": 1, "op": "x"}}}})
    assert sorted(merge([a, b, "", "not json"])) == [0, 1]


def test_a_worker_answers_its_agent_from_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a process group the summary says so; the answer comes from the dump thread
    while the main thread is busy elsewhere."""
    path = str(tmp_path / "collectives")
    monkeypatch.setenv(worker_side.ENV_COLLECTIVES_FILE, path)
    monkeypatch.setattr(worker_side, "POLL_S", 0.01)
    thread = worker_side.start_dump_thread()
    assert isinstance(thread, threading.Thread) and thread.daemon
    (answer,) = worker_side.ask_dump({3: path}, timeout_s=10).values()
    assert answer["groups"] == {} and answer["error"], answer
    # No thread answers this one: the agent says so within its deadline.
    silent = worker_side.ask_dump({4: str(tmp_path / "nobody")}, timeout_s=0.2)
    assert "no answer within" in silent[4]["error"]
