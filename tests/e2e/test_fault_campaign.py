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
    ran = [row for row in rows if row["verdict"] != "not run"]
    assert ran, rows  # a job is not run where its kind cannot be (no cgroup, no tmpfs mount)
    for row in ran:
        # completed means exit 0 with the failure-free model's hash; the counts say why not.
        expected = "failed fast" if row["should_fail"] else "completed"
        assert row["verdict"] == expected, (SEED, row, r.stderr[-3000:])
        assert (row["lost"], row["duplicated"]) == (0, 0), (SEED, row)
        assert (row["torn"], row["orphans"], row["leaks"]) == (False, 0, []), (SEED, row)
