"""The fault campaign's short CI variant: 4 seeded dlrover jobs with random faults, every verdict right.

benchmarks/fault_campaign.py with ``--jobs 4 --seed 3 --no-torchrun``: real `dlrover submit`
jobs of 2-3 nodes (dynamic shards, flash checkpoints, the per-sample counter oracle), each with
1-4 faults. DLROVER_CAMPAIGN_SEED replays another draw. Then one stream job (broker outages
and a worker SIGKILL; needs the Kafka extras) and one PS job (an embedding server SIGKILLed
twice), each with its failure-free run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, clean_env
from tests.kafka_broker import kafka_missing

SEED = os.environ.get("DLROVER_CAMPAIGN_SEED", "3")


def _campaign(tmp_path: Path, *args: str, timeout: float) -> list[dict[str, object]]:
    """`benchmarks/fault_campaign.py --no-torchrun ARGS`: every job's JSON row (with the run's
    output)."""
    results = tmp_path / "results.json"
    r = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "fault_campaign.py"), "--no-torchrun", *args,
         "--json", str(results)],
        env=clean_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr[-5000:]
    rows: list[dict[str, object]] = json.loads(results.read_text())
    for row in rows:  # what a failed assertion shows: the table and the kept folders' notes
        row["output"] = r.stdout + r.stderr[-3000:]
    return rows


@pytest.mark.long
@pytest.mark.campaign
@pytest.mark.timeout(1500)
def test_every_job_of_a_small_campaign_ends_as_it_should(tmp_path: Path) -> None:
    rows = _campaign(tmp_path, "--jobs", "4", "--seed", SEED, timeout=1400)
    assert len(rows) == 4, rows
    ran = [row for row in rows if row["verdict"] != "not run"]
    assert ran, rows  # a job is not run where its kind cannot be (no cgroup, no tmpfs mount)
    for row in ran:
        # completed means exit 0 with the failure-free model's hash; the counts say why not.
        expected = "failed fast" if row["should_fail"] else "completed"
        assert row["verdict"] == expected, (SEED, row)
        assert (row["lost"], row["duplicated"]) == (0, 0), (SEED, row)
        assert (row["torn"], row["orphans"], row["leaks"]) == (False, 0, []), (SEED, row)


def _campaign_job(tmp_path: Path, seed: str, index: int) -> dict[str, object]:
    """Run job ``index`` of the ``seed`` draw of 6 (and its failure-free run): its JSON row."""
    [row] = _campaign(tmp_path, "--jobs", "6", "--seed", seed, "--only", str(index), timeout=600)
    # Every fault of it fired; a PS job: every killed server replaced, no worker restarted.
    assert row["note"] == "", row
    return row


@pytest.mark.extras
@pytest.mark.skipif(bool(kafka_missing()), reason=kafka_missing() or "ok")
@pytest.mark.timeout(700)
def test_a_stream_job_through_two_broker_outages_and_a_worker_kill_trains_every_record_once(
    tmp_path: Path,
) -> None:
    # Seed 7's job 4: 2 nodes, outages at steps 7 (4 s) and 21 (1 s), rank 0 SIGKILLed at step 8.
    row = _campaign_job(tmp_path, "7", 4)
    assert row["faults"] == "broker_outage@s7(4s), broker_outage@s21(1s), worker_kill@r0s8"
    assert row["verdict"] == "completed", row  # exit 0 and every record's counter at 1
    assert (row["lost"], row["duplicated"], row["torn"]) == (0, 0, False), row
    assert (row["orphans"], row["leaks"]) == (0, []), row


@pytest.mark.long
@pytest.mark.e2e
@pytest.mark.timeout(700)
def test_a_ps_job_whose_server_is_killed_twice_ends_with_the_failure_free_model(
    tmp_path: Path,
) -> None:
    # Seed 7's job 5: 2 servers; server 0 SIGKILLed at step 160, its replacement at step 164.
    row = _campaign_job(tmp_path, "7", 5)
    assert row["faults"] == "ps_kill@ps0s160, ps_kill@ps0s164"
    assert row["verdict"] == "completed", row  # exit 0 and the failure-free run's model
    assert (row["orphans"], row["leaks"]) == (0, []), row
