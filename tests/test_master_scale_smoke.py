"""`benchmarks/master_scale.py` at a small size, so the benchmark behind the scale figures keeps
working: 300 simulated agents against a real dlrover-master form one round, hold their watches
and all pass the exit barrier; the master exits 0."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "master_scale.py"


@pytest.mark.e2e
def test_300_simulated_agents_complete_a_job_on_a_real_master():
    spec = importlib.util.spec_from_file_location("master_scale", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["master_scale"] = bench
    spec.loader.exec_module(bench)
    row = asyncio.run(bench.run_one(300, 1.0, poll=False))
    assert row["exit_ok"] == 300 and row["errors"] == 0
    assert row["master_exit"] == "0"
    assert row["rendezvous_s"] < 20  # a generous bound: CI machines are slow and shared
