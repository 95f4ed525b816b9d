"""dashboards/grafana/dlrover.json: an importable Grafana dashboard whose every query a real
Prometheus, scraping a real job's master, answers with data.

The JSON's shape is checked without Prometheus; the queries need Debian's `prometheus`, which
`.ci/run` installs for the extras stage. The job has a worker SIGKILLed mid-run, so that the
restart, failure and recovery panels have series too.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, SCRIPTS, clean_env, free_port, run_cmd

pytestmark = pytest.mark.extras

DASHBOARD = REPO / "dashboards" / "grafana" / "dlrover.json"
JOB_NAME = "grafana"
# What Grafana puts in place of its own variables when it runs a panel's query.
GRAFANA_VARS = {"$__rate_interval": "10s", "$__interval": "5s", "$__range": "5m"}
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
LABEL_VALUES = re.compile(r"^label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*(\w+)\s*\)$")


def _board() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def _panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel that shows data (the panels of a row included, rows themselves not)."""
    found = []
    for panel in board["panels"]:
        if panel.get("type") == "row":
            found.extend(panel.get("panels", []))
        else:
            found.append(panel)
    return found


def _datasource_ref(board: dict[str, Any]) -> dict[str, str]:
    """The datasource every panel must name: the dashboard's Prometheus import input."""
    inputs = [
        i
        for i in board.get("__inputs", [])
        if i.get("type") == "datasource" and i.get("pluginId") == "prometheus"
    ]
    assert len(inputs) == 1, f"one prometheus datasource input expected: {inputs}"
    return {"type": "prometheus", "uid": "${" + inputs[0]["name"] + "}"}


def _job_variable(board: dict[str, Any]) -> dict[str, Any]:
    found = [v for v in board["templating"]["list"] if v["name"] == "job_name"]
    assert len(found) == 1, board["templating"]
    return found[0]  # type: ignore[no-any-return]


def _variable_query(variable: dict[str, Any]) -> str:
    query = variable["query"]
    return str(query["query"] if isinstance(query, dict) else query)


def _promql(expr: str, job_name: str) -> str:
    """A panel's query as Grafana sends it for ``job_name``."""
    for name, value in GRAFANA_VARS.items():
        expr = expr.replace("${" + name[1:] + "}", value).replace(name, value)
    expr = expr.replace("${job_name}", job_name).replace("$job_name", job_name)
    assert "$" not in expr, f"a variable this test does not know in {expr!r}"
    return expr


def test_the_dashboard_is_an_importable_grafana_dashboard() -> None:
    board = _board()
    assert board["schemaVersion"] >= 36 and board["title"] and board["uid"]
    assert board.get("id") is None, "an exported dashboard carries no database id"
    ref = _datasource_ref(board)
    panels = _panels(board)
    assert panels
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"panel ids collide: {sorted(ids)}"
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        title = panel.get("title")
        assert title, f"panel {panel['id']} has no title"
        assert panel["type"] in ("timeseries", "stat"), (title, panel["type"])
        assert panel.get("datasource") == ref, (title, panel.get("datasource"))
        assert panel["fieldConfig"]["defaults"].get("unit"), f"{title}: no unit"
        targets = panel.get("targets", [])
        assert targets, f"{title}: no target"
        refs = [t["refId"] for t in targets]
        assert len(refs) == len(set(refs)), f"{title}: refIds collide: {refs}"
        for t in targets:
            assert t.get("datasource", ref) == ref, (title, t)
            assert t.get("expr"), f"{title}/{t['refId']}: no expr"
            # Every query is for the chosen job only.
            assert '{job_name="$job_name"' in t["expr"], (title, t["expr"])
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, (title, pos)
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{title} overlaps {cells[(x, y)]}"
                cells[(x, y)] = title
    variable = _job_variable(board)
    assert variable["type"] == "query" and variable["datasource"] == ref, variable
    assert LABEL_VALUES.match(_variable_query(variable)), _variable_query(variable)


@pytest.fixture
def job(tmp_path: Path) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """A 2-node job of ~80 steps (0.1 s each) whose rank 1 is SIGKILLed at step 30, with its
    metrics port."""
    port = free_port()
    (tmp_path / "ckpt").mkdir()
    cmd = [
        *run_cmd("dlrover.cli.job"), "submit", "--name", JOB_NAME, "--nnodes", "2",
        "--nproc-per-node", "1", "--metrics-port", str(port), str(SCRIPTS / "oracle_train.py"),
        "--steps", "80", "--step-time", "0.1", "--ckpt", str(tmp_path / "ckpt"),
        "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    env = clean_env(DLROVER_HOME=str(tmp_path / "home"), DLROVER_FAULTS="kill:rank=1:step=30")
    # A file, not a pipe: nobody reads the job's stderr while it runs, and a full pipe blocks it.
    err_path = tmp_path / "submit.err"
    with err_path.open("w") as err:
        proc = subprocess.Popen(
            cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, text=True
        )
    try:
        yield port, proc
        proc.wait(timeout=120)
        assert proc.returncode == 0, err_path.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


class Prometheus:
    """A real Prometheus on loopback scraping ``target`` every second."""

    def __init__(self, tmp: Path, target: str) -> None:
        self.port = free_port()
        config = tmp / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            f"  - job_name: dlrover\n    static_configs: [{{targets: ['{target}']}}]\n"
        )
        self.log = tmp / "prometheus.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [
                    "prometheus",
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],  # fmt: skip
                stdout=subprocess.DEVNULL,
                stderr=log,
            )

    def get(self, path: str, **params: str) -> Any:
        """The `data` of an API answer; a query Prometheus refuses fails the test with its error."""
        url = f"http://127.0.0.1:{self.port}{path}?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                answer = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise AssertionError(f"Prometheus refused {params}: {e.read().decode()}") from None
        assert answer["status"] == "success", (params, answer)
        return answer["data"]

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"Prometheus not ready: {self.log.read_text()[-3000:]}")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="apt-get install prometheus")
def test_every_panel_query_returns_series_from_a_real_prometheus(
    tmp_path: Path, job: tuple[int, subprocess.Popen[str]]
) -> None:
    port, proc = job
    board = _board()
    queries = {
        f"{panel['title']} / {t['refId']}": (
            _promql(t["expr"], JOB_NAME),
            t.get("legendFormat", ""),
        )
        for panel in _panels(board)
        for t in panel["targets"]
    }
    metric, label = LABEL_VALUES.match(_variable_query(_job_variable(board))).groups()  # type: ignore[union-attr]
    prom = Prometheus(tmp_path, f"127.0.0.1:{port}")
    try:
        prom.wait_ready()
        # Every query is valid PromQL from the start (an invalid one fails at once) ...
        for expr, _ in queries.values():
            prom.get("/api/v1/query", query=expr)
        # ... and each returns at least one series at some point while the job runs (the
        # restart panels only after the kill at step 30), each series with the labels its
        # legend names. Once the job ended, one more round: a series not there by then never
        # comes (and the master's series go stale).
        pending = dict(queries)
        names: list[str] = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            ended = proc.poll() is not None
            for name, (expr, legend) in list(pending.items()):
                series = prom.get("/api/v1/query", query=expr)["result"]
                for s in series:
                    missing = set(LEGEND_LABEL.findall(legend)) - set(s["metric"])
                    assert not missing, f"{name}: legend {legend!r} names {missing}, not in {s}"
                if series:
                    del pending[name]
            if not names:
                names = prom.get(f"/api/v1/label/{label}/values", **{"match[]": metric})
            if (not pending and names) or ended:
                break
            time.sleep(0.5)  # the next round of queries (Prometheus scrapes every second)
        assert not pending, "queries without a series while the job ran:\n" + "\n".join(
            f"  {name}: {expr}" for name, (expr, _) in pending.items()
        )
        # The job picker lists the job.
        assert JOB_NAME in names, f"label_values({metric}, {label}) gave {names}"
    finally:
        prom.close()
