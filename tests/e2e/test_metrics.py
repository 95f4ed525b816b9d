"""The master's /metrics, dashboard and JSON, scraped from a real job while it trains."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import REPO, SCRIPTS, clean_env, dlrover_run, free_port, run_cmd


class Scraper:
    """Polls a master's pages every 0.2 s while the job runs; keeps the latest answers."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.metrics = ""
        self.status: dict[str, object] = {}
        self.seen_running: set[int] = set()
        self.usage_seen = 0
        """The most nodes with CPU and memory series in one scrape."""
        self.checkpoint_s: dict[str, float] = {}
        """The largest dlrover_checkpoint_seconds seen, per kind (save, persist)."""
        self.compute_s = 0.0
        """The largest compute seconds per step seen on both nodes at once."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.base + path, timeout=5) as r:
            return r.read().decode()

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            try:
                self.metrics = self.get("/metrics")
                self.status = json.loads(self.get("/api/status"))
            except OSError:
                continue  # not up yet, or gone
            running = [n for n in self.status["nodes"] if n["state"] == "running"]  # type: ignore[attr-defined,index]
            self.seen_running.add(len(running))
            mem = [v for (name, _), v in samples(self.metrics).items() if name == "dlrover_node_memory_bytes" and v > 50e6]  # fmt: skip
            self.usage_seen = max(self.usage_seen, len(mem))
            compute = [v for (name, labels), v in samples(self.metrics).items() if name == "dlrover_node_step_seconds" and ("phase", "compute") in labels]  # fmt: skip
            if len(compute) == 2:
                self.compute_s = max(self.compute_s, min(compute))
            for (name, labels), v in samples(self.metrics).items():
                if name == "dlrover_checkpoint_seconds":
                    kind = dict(labels)["kind"]
                    self.checkpoint_s[kind] = max(self.checkpoint_s.get(kind, 0.0), v)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "job_name")))] = (
                s.value
            )
    return out


@pytest.mark.e2e
def test_metrics_and_dashboard_of_a_job_with_a_failure(tmp_path: Path) -> None:
    """2 nodes train; rank 1 raises at step 15 (restart in place). Scraped all along, the
    master reports goodput, badput by reason, steps, nodes, usage, restarts by class; the
    dashboard page and its JSON serve the same job, the log tail its node's output."""
    port = free_port()
    (tmp_path / "ckpt").mkdir()
    cmd = [
        *run_cmd("dlrover.cli.job"), "submit", "--name", "met", "--nnodes", "2",
        "--nproc-per-node", "1", "--metrics-port", str(port),
        "--tensorboard-dir", str(tmp_path / "tb"), str(SCRIPTS / "flash_train.py"),
        "--steps", "80", "--step-time", "0.1", "--disk-every", "5", "--ckpt", str(tmp_path / "ckpt"),
        "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    env = clean_env(DLROVER_HOME=str(tmp_path / "home"), DLROVER_FAULTS="raise:rank=1:step=15")
    # Output goes to files: a pipe nobody reads while the process runs can fill and block it.
    err_path, shown_path = tmp_path / "submit.err", tmp_path / "watch.out"
    with err_path.open("w") as err:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stderr=err, text=True)
    scraper = Scraper(port)
    page = ""
    log = None
    watch: subprocess.Popen[str] | None = None
    deadline = time.monotonic() + 120
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            nodes = scraper.status.get("nodes") or []
            if not page and nodes:
                page = scraper.get("/")
                node = nodes[0]["node_id"]  # type: ignore[index]
                log = scraper.get(f"/api/log?node={node}&lines=50")
                with shown_path.open("w") as shown_file:
                    watch = subprocess.Popen(
                        [*run_cmd("dlrover.cli.job"), "status", "met", "--watch", "0.5"],
                        env=env, cwd=REPO, stdout=shown_file, text=True,
                    )  # fmt: skip
            time.sleep(0.2)
        proc.wait(timeout=60)
        if watch is not None:
            watch.wait(timeout=30)  # it ends by itself with the job
    finally:
        scraper.stop()
        for child in (proc, watch):
            if child is not None and child.poll() is None:
                child.kill()
                child.wait(10)
    stderr = err_path.read_text()
    assert proc.returncode == 0, stderr[-4000:]
    assert f"metrics and dashboard on http://127.0.0.1:{port}/" in stderr

    m = samples(scraper.metrics)  # the last scrape before the master stopped
    ratio = m[("dlrover_goodput_ratio", ())]
    productive = m[("dlrover_productive_seconds_total", ())]
    badput = {r: m[("dlrover_badput_seconds_total", (("reason", r),))] for r in ("startup", "restart", "rollback", "idle")}  # fmt: skip
    assert 0.1 < ratio < 1.0, m
    assert productive > 2.0  # >= 25 new steps of >= 0.1 s were seen
    assert badput["startup"] > 0 and badput["restart"] > 0, badput
    assert m[("dlrover_job_steps_total", ())] >= 50  # the last steps may follow the last scrape
    assert m[("dlrover_restarts_total", (("action", "restart_processes"), ("reason", "user_error")))] >= 1  # fmt: skip
    assert m[("dlrover_failures_total", (("reason", "user_error"),))] >= 1
    assert scraper.usage_seen == 2  # both nodes' agent + worker, resident while they ran
    assert 0.09 < scraper.compute_s < 1.0  # each step sleeps 0.1 s (the script's "compute")
    # Every step saves to memory (training waits for it), every 5th also persists to disk.
    assert scraper.checkpoint_s.get("save", 0) > 0 and scraper.checkpoint_s.get("persist", 0) > 0
    assert m[("dlrover_recovery_seconds_count", ())] >= 1  # the restart after step 15
    assert 2 in scraper.seen_running

    status = scraper.status
    assert status["job_name"] == "met" and len(status["nodes"]) == 2  # type: ignore[arg-type]
    kinds = {e["kind"] for e in status["events"]}  # type: ignore[attr-defined,union-attr]
    assert {"round", "failure", "ckpt"} <= kinds, status["events"]
    assert any("user_error" in e["text"] for e in status["events"])  # type: ignore[attr-defined,union-attr]
    assert status["goodput"]["history"]  # type: ignore[index]
    assert "<title>DLRover job</title>" in page
    assert log is not None and "dlrover" in log
    assert watch is not None and watch.returncode == 0
    shown = shown_path.read_text()
    assert shown.count(f"dashboard: http://127.0.0.1:{port}/") >= 2, shown
    assert re.search(r"job met: running \(round \d+, goodput \d+\.\d%\)", shown), shown
    # It ends with the ended job's state line, then its last table (and plans, failures).
    state_lines = [line for line in shown.splitlines() if line.startswith("job met: ")]
    assert state_lines[-1].startswith("job met: succeeded"), shown
    ended = shown.split("job met: succeeded", 1)[1]
    # The injected fault is listed; under load the peer's rank can also fail on the broken
    # collective before its restart is ordered, and is then listed as a failure of its own.
    failures = re.search(r"failures \((\d+)\):", ended)
    assert failures is not None and int(failures.group(1)) >= 1, shown
    assert "user_error   restart_processes" in ended and "injected fault at step 15" in ended, shown

    from tests.test_tensorboard import _records

    (events,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    written = _records(events)
    assert (
        len(written) >= 2 and b"goodput/ratio" in written[-1] and b"badput/restart" in written[-1]
    )


def test_a_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        busy = s.getsockname()[1]
        r = subprocess.run(
            [*run_cmd("dlrover.cli.master"), "--port", "0", "--metrics-port", str(busy)],
            env=clean_env(DLROVER_HOME=str(tmp_path)),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert r.returncode == 1
    assert re.search(rf"cannot serve metrics on 0.0.0.0:{busy}: .*pick another --metrics-port", r.stderr), r.stderr  # fmt: skip


def test_dlrover_run_with_a_taken_metrics_port_exits_with_a_clear_error(tmp_path: Path) -> None:
    """The node that can bind --rdzv-endpoint hosts the master; a taken --metrics-port is its
    own error, not "another node hosts the master" (that would join its own, unserved port)."""
    import socket

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        busy = s.getsockname()[1]
        r = dlrover_run(
            ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
             "--metrics-port", str(busy), str(SCRIPTS / "dump_env.py"), str(tmp_path)],
            timeout=60,
        )  # fmt: skip
    assert r.returncode == 1, r.stderr[-3000:]
    assert (
        f"dlrover-run: error: cannot serve metrics on 0.0.0.0:{busy}: the port is taken; pick "
        "another --metrics-port" in r.stderr
    ), r.stderr[-3000:]
    assert "joining it" not in r.stderr and not list(tmp_path.glob("env.*"))


def test_standalone_serves_metrics_too(tmp_path: Path) -> None:
    """dlrover-run --standalone embeds the master: its workers can scrape it while they run."""
    port = free_port()
    script = tmp_path / "scrape.py"
    script.write_text(
        "import sys, urllib.request\n"
        f"page = urllib.request.urlopen('http://127.0.0.1:{port}/metrics', timeout=10).read()\n"
        "open(sys.argv[1], 'wb').write(page)\n"
    )
    r = subprocess.run(
        [*run_cmd("dlrover.cli.run"), "--standalone", "--nproc-per-node", "1",
         "--metrics-port", str(port), str(script), str(tmp_path / "page")],
        env=clean_env(), cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"metrics and dashboard: http://127.0.0.1:{port}/" in r.stderr
    m = samples((tmp_path / "page").read_text())
    assert m[("dlrover_nodes", (("state", "running"),))] == 1.0
