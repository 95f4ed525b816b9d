"""The fault campaign's short CI variant: 4 seeded dlrover jobs with random faults, every verdict right.

benchmarks/fault_campaign.py with ``--jobs 4 --seed 3 --no-torchrun``: real `dlrover submit`
jobs of 2-3 nodes (dynamic shards, flash checkpoints, the per-sample counter oracle), each with
1-4 faults. DLROVER_CAMPAIGN_SEED replays another draw.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, clean_env

SEED = os.environ.get("DLROVER_CAMPAIGN_SEED", "3")


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_job_of_a_small_campaign_ends_as_it_should(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "fault_campaign.py"),
            "--jobs",
            "4",
            "--seed",
            SEED,
            "--no-torchrun",
            "--json",
            str(results),
        ],  # fmt: skip
        env=clean_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1400,
    )
    assert r.returncode == 0, r.stdout + r.stderr[-5000:]
    rows = json.loads(results.read_text())
    assert len(rows) == 4, r.stdout
    known = []
    for row in rows:
        assert (row["torn"], row["orphans"], row["leaks"]) == (False, 0, []), (SEED, row)
        expected = "failed fast" if row["should_fail"] else "completed"
        if row["verdict"] == expected:
            assert (row["lost"], row["duplicated"]) == (0, 0), (SEED, row)
            continue
        # Open finding of the campaign (docs/fault_tolerance.md): a should-complete job whose
        # workers restarted from a checkpoint may end with samples trained twice (seen after
        # worker SIGKILLs alone) or not at all. Every other wrong outcome fails the test.
        assert not row["should_fail"] and row["verdict"] == "wrong", (SEED, row, r.stderr[-3000:])
        assert row["lost"] or row["duplicated"], (SEED, row)
        known.append(row)
    if known:
        pytest.xfail(f"open: samples lost or duplicated after restarts: {known}")
