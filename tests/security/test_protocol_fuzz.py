"""The protocol fuzzer's CI run: every port DLRover listens on (master gRPC, embedding server
gRPC and data port, checkpoint saver socket, replica port) survives seeded abuse and answers
each case clearly.

benchmarks/protocol_fuzz.py with a fixed seed and ``--cases 150`` per target, real servers
on port 0 in processes of their own. DLROVER_FUZZ_SEED replays another draw.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, clean_env

SEED = os.environ.get("DLROVER_FUZZ_SEED", "7")
CASES = 150
TARGETS = ("master", "master-heartbeats", "embedding", "embedding-data", "saver", "replica")


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_every_server_survives_the_fuzzer_and_answers_each_case_clearly(tmp_path: Path) -> None:
    results = tmp_path / "fuzz.json"
    r = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "protocol_fuzz.py"),
            "--cases",
            str(CASES),
            "--seed",
            SEED,
            "--stalls",
            "16",
            "--json",
            str(results),
        ],  # fmt: skip
        env=clean_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rows = {row["target"]: row for row in json.loads(results.read_text())}
    assert sorted(rows) == sorted(TARGETS)
    for name, row in rows.items():
        outcomes = row["outcomes"]
        assert row["cases"] == CASES and sum(outcomes.values()) == CASES, (name, row)
        assert not {"unclear", "hang", "crash"} & set(outcomes), (name, row["examples"])
        assert row["probe_failures"] == 0 and row["refused_connections"] == 0, (name, row)
        assert row["threads_after"] <= row["threads_before"] + 4, (name, row)
        # The abuse was the abuse asked for: most cases refused, with every kind drawn.
        assert outcomes["clear"] > CASES // 2, (name, outcomes)
        assert {"oversized", "truncated_stream"} <= set(row["kinds"]), (name, row["kinds"])
    for name in ("master", "master-heartbeats", "embedding", "embedding-data"):
        assert {"random_bytes", "wrong_token", "no_token", "bit_flips"} <= set(rows[name]["kinds"])
    for name in ("saver", "replica"):
        assert {"deep_nesting", "repeat_key", "unknown_op"} <= set(rows[name]["kinds"])
