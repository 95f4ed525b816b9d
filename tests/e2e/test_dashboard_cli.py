"""`dlrover dashboard` and `dlrover top` against real jobs of one `$DLROVER_HOME`: the jobs list,
each job's JSON proxied from its master while it runs and read from what it left once it ended,
and the terminal table live and final."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, SCRIPTS, clean_env, free_port, run_cmd

pytestmark = pytest.mark.e2e


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _until(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (OSError, ValueError) as e:  # not serving yet
            last = e
        else:
            if last:
                return last
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


def test_the_jobs_of_a_home_in_one_place_and_a_live_table(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = clean_env(DLROVER_HOME=str(home), DLROVER_FAULTS="kill:rank=1:step=40")
    port = free_port()
    dashboard = subprocess.Popen(
        [*run_cmd("dlrover.cli.job"), "dashboard", "--port", str(port)],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    (tmp_path / "ckpt").mkdir()
    err_path = tmp_path / "submit.err"
    with err_path.open("w") as err:
        job = subprocess.Popen(
            [
                *run_cmd("dlrover.cli.job"), "submit", "--name", "table", "--nnodes", "2",
                "--nproc-per-node", "1", str(SCRIPTS / "oracle_train.py"), "--steps", "120",
                "--step-time", "0.08", "--ckpt", str(tmp_path / "ckpt"),
                "--out", str(tmp_path / "out"),
            ],
            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, text=True,
        )  # fmt: skip
    top = [*run_cmd("dlrover.cli.job"), "top", "table"]
    base = f"http://127.0.0.1:{port}"
    try:
        assert dashboard.stdout is not None
        assert f":{port}/" in dashboard.stdout.readline()  # it says where it serves

        def running() -> list[dict[str, Any]]:
            return [j for j in _get(base + "/api/jobs") if j["state"] == "running"]

        (row,) = _until("the job listed as running", running)
        assert row["name"] == "table" and row["engine"] == "local" and row["started_at"] > 0

        # The live table: both nodes with their samples/s (the script reports its samples).
        def live_table() -> str:
            out = subprocess.run(
                [*top, "--count", "1"], env=env, cwd=REPO, capture_output=True, text=True,
                timeout=30,
            )  # fmt: skip
            assert out.returncode == 0, out.stderr
            rows = [r for line in out.stdout.splitlines() if (r := line.split())[:1]
                    and r[0].startswith("table-worker")]  # fmt: skip
            measured = [r for r in rows if len(r) >= 5 and r[4] != "-" and float(r[4]) > 0]
            return out.stdout if len(measured) == 2 else ""

        text = _until("samples/s of both nodes in dlrover top", live_table)
        assert "job table: running" in text and "samples/s" in text, text

        # The job's history, proxied from its master while it runs.
        history = _until(
            "two samples in the job's history",
            lambda: (h := _get(base + "/jobs/table/api/history")) and len(h["t"]) >= 2 and h,
        )
        assert set(history["nodes"]) == {"table-worker-0-0", "table-worker-1-0"}

        job.wait(timeout=120)
        assert job.returncode == 0, err_path.read_text()[-3000:]

        # Ended: the list, the job's status and history come from what the job left.
        (ended,) = _get(base + "/api/jobs")
        assert ended["state"] == "succeeded" and ended["ended_at"] > ended["started_at"]
        assert ended["steps"] == 120 and 0 < ended["goodput"] <= 1
        status = _get(base + "/jobs/table/api/status")
        assert status["state"] == "succeeded" and len(status["nodes"]) == 2
        kinds = {e["kind"] for e in status["events"]}
        assert {"failure", "round"} <= kinds, kinds
        history = _get(base + "/jobs/table/api/history")
        assert len(history["t"]) >= 4 and len(history["goodput"]) == len(history["t"])
        failure = [m for m in history["markers"] if m["kind"] == "failure"]
        assert len(failure) == 1 and "SIGKILL" in failure[0]["text"], history["markers"]
        samples = [v for n in history["nodes"].values() for v in n["samples_per_s"] if v]
        assert samples, history["nodes"]
        with pytest.raises(urllib.error.HTTPError) as missing:
            _get(base + "/jobs/nope/api/status")
        assert missing.value.code == 404

        # `dlrover top` of the ended job: its final table once, then it exits.
        out = subprocess.run(top, env=env, cwd=REPO, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert "job table: succeeded" in out.stdout and "SIGKILL" in out.stdout, out.stdout
        assert out.stdout.count("table-worker-") >= 2
    finally:
        for proc in (job, dashboard):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def test_top_and_dashboard_say_what_is_wrong(tmp_path: Path) -> None:
    env = clean_env(DLROVER_HOME=str(tmp_path / "home"))
    out = subprocess.run(
        [*run_cmd("dlrover.cli.job"), "top", "ghost"], env=env, cwd=REPO, capture_output=True,
        text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 1 and "no job named 'ghost'" in out.stderr, out.stderr
    # A taken port: said, with what to do.
    with subprocess.Popen(
        [*run_cmd("dlrover.cli.job"), "dashboard", "--port", "0"],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    ) as first:  # fmt: skip
        try:
            assert first.stdout is not None
            line = first.stdout.readline()
            port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
            assert _get(f"http://127.0.0.1:{port}/api/jobs") == []
            second = subprocess.run(
                [*run_cmd("dlrover.cli.job"), "dashboard", "--port", str(port)],
                env=env, cwd=REPO, capture_output=True, text=True, timeout=30,
            )  # fmt: skip
            assert second.returncode == 1
            assert "port is taken" in second.stderr and "--port" in second.stderr, second.stderr
        finally:
            first.kill()


def test_a_dlrover_run_job_is_listed_and_left_behind_as_a_submitted_one(tmp_path: Path) -> None:
    """`dlrover-run --standalone` hosts its master: it keeps the same record as `dlrover submit`,
    so the README's first job is in `dlrover dashboard`, `dlrover top` and `dlrover status`,
    while it runs and after it ended."""
    home = tmp_path / "home"
    env = clean_env(DLROVER_HOME=str(home))
    (tmp_path / "ckpt").mkdir()
    run = subprocess.Popen(
        [
            *run_cmd("dlrover.cli.run"), "--standalone", "--nproc_per_node=2", "--rdzv-id",
            "quick", str(SCRIPTS / "oracle_train.py"), "--steps", "60", "--step-time", "0.08",
            "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"),
        ],
        env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    port = free_port()
    dashboard = subprocess.Popen(
        [*run_cmd("dlrover.cli.job"), "dashboard", "--port", str(port)],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        assert dashboard.stdout is not None and "http://" in dashboard.stdout.readline()
        (row,) = _until(
            "the dlrover-run job listed as running",
            lambda: [j for j in _get(base + "/api/jobs") if j["state"] == "running"],
        )
        assert row["name"] == "quick" and row["engine"] == "dlrover-run", row
        live = _until(
            "its page's history", lambda: (h := _get(base + "/jobs/quick/api/history"))["t"] and h
        )
        assert list(live["nodes"]) and "quick" in _get(base + "/jobs/quick/api/status")["job_name"]
        _, err = run.communicate(timeout=120)
        assert run.returncode == 0, err[-3000:]
        (ended,) = _get(base + "/api/jobs")
        assert ended["state"] == "succeeded" and ended["steps"] == 60, ended
        out = subprocess.run(
            [*run_cmd("dlrover.cli.job"), "top", "quick"], env=env, cwd=REPO,
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert out.returncode == 0 and "job quick: succeeded" in out.stdout, out
    finally:
        for proc in (run, dashboard):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
