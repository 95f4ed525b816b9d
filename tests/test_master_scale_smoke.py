"""`benchmarks/master_scale.py` at a small size, so the benchmark behind the scale figures keeps
working: 300 simulated agents against a real dlrover-master form one round, hold their watches
and all pass the exit barrier; the master exits 0. Each storm of the benchmark runs here too,
at the same size."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "master_scale.py"


def _bench():
    spec = importlib.util.spec_from_file_location("master_scale", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["master_scale"] = bench
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.e2e
def test_300_simulated_agents_complete_a_job_on_a_real_master():
    bench = _bench()
    row = asyncio.run(bench.run_one(300, 1.0, poll=False))
    assert row["exit_ok"] == 300 and row["errors"] == 0
    assert row["master_exit"] == "0"
    assert row["rendezvous_s"] < 20  # a generous bound: CI machines are slow and shared


@pytest.mark.e2e
def test_an_error_storm_of_300_nodes_is_answered_as_one_folded_failure():
    """`--storm errors` at 300 nodes: every node reports the same failure (numbers aside) with a
    64 KB stack, twice; the master keeps answering heartbeats, `dlrover diagnose`'s call
    answers within 2 s with one record that counts all 600 reports from the 300 nodes."""
    bench = _bench()
    row = asyncio.run(bench.run_one(300, 1.0, poll=False, storm="errors", gap_s=1.0))
    assert row["errors"] == 0 and row["exit_ok"] == 300 and row["master_exit"] == "0"
    assert isinstance(row["diagnose_s"], float), row["diagnose_s"]  # else: why it failed
    assert row["diagnose_s"] < 2.0
    assert (row["records"], row["lines"]) == (1, 2)  # the header and the storm's line
    assert (row["folded_count"], row["folded_nodes"]) == (600, 300)


@pytest.mark.e2e
def test_a_tenth_of_300_nodes_lost_at_once_is_recorded_once_each_and_replaced():
    """`--storm lose:0.1` at 300 nodes: 30 nodes go silent at once; the master loses each of
    them exactly once, the survivors re-join without a refusal, the 30 replacements make the
    round whole again, and all 300 nodes of it pass the exit barrier."""
    bench = _bench()
    row = asyncio.run(bench.run_one(300, 1.0, poll=False, storm="lose:0.1"))
    assert (row["lost"], row["lost_recorded"], row["lost_nodes"]) == (30, 30, 30)
    assert row["refused"] == 0 and row["round"] == 2
    assert row["exit_ok"] == 300 and row["errors"] == 0 and row["master_exit"] == "0"


@pytest.mark.e2e
def test_a_tenth_of_300_nodes_lost_at_once_is_relaunched_through_a_rate_limited_engine(
    monkeypatch: pytest.MonkeyPatch,
):
    """`--storm lose:0.1 --engine fake:100:0.5:2` at 300 nodes: the master's node controller
    runs over a fake engine that creates at most 100 pods a second; it reports 15 of the 30
    lost nodes, the other 15 only go silent. Each is lost once, every replacement goes to the
    engine (the reported ones at once, the silent ones after the grace) without one launch
    refused, the replacements' agents make the round whole, and all 300 pass the exit barrier."""
    monkeypatch.setenv("DLROVER_SILENT_REPLACE_S", "1")  # the master process inherits it
    bench = _bench()
    row = asyncio.run(
        bench.run_one(300, 1.0, poll=False, storm="lose:0.1", engine="fake:100:0.5:2")
    )
    assert (row["lost"], row["lost_recorded"], row["lost_nodes"]) == (30, 30, 30)
    assert row["engine_refused"] == 0 and row["refused"] == 0 and row["round"] == 2
    assert row["handed_reported_s"] < 2.0, row
    assert row["handed_silent_s"] < 1.0 + 2.0, row  # the grace, then the same
    assert row["exit_ok"] == 300 and row["errors"] == 0 and row["master_exit"] == "0"


@pytest.mark.e2e
def test_a_master_killed_mid_rendezvous_and_in_steady_state_loses_no_node_of_300():
    """`--storm master-kill` at 300 nodes: the master SIGKILLed once half the nodes joined the
    first round, and again in the steady state while the nodes lease, train and report the
    shards of a dataset, restarted each time on its state; the round forms once, every node's
    heartbeat is answered again, none is recorded lost, no round re-forms, every shard is done
    once and none was handed to two workers, and all 300 pass the exit barrier."""
    bench = _bench()
    row = asyncio.run(bench.run_one(300, 1.0, poll=False, storm="master-kill"))
    assert (row["not_adopted"], row["lost_recorded"], row["reforms"]) == (0, 0, 0)
    assert row["shards"] >= 200 * bench.SHARDS_PER_LEASER, row
    assert row["shards_done"] == row["master_done_shards"] == row["shards"], row
    assert (row["shards_lost"], row["done_twice"], row["granted_twice"]) == (0, 0, 0), row
    assert row["lease_calls_asked_again"] > 0, row  # the kill came while shards were leased
    assert row["exit_ok"] == 300 and row["errors"] == 0 and row["master_exit"] == "0"
    assert row["adopted_s"] < 30  # generous: a busy CI machine (3.3 s at 200 nodes here)
