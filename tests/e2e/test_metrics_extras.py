"""The master's metrics scraped by a real Prometheus, its dashboard in a real headless Chromium.

Both need programs from Debian (prometheus, chromium) and Playwright from PyPI; `.ci/run`
installs them for the extras stage.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, SCRIPTS, clean_env, free_port, run_cmd

pytestmark = pytest.mark.extras

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
def job(
    tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[tuple[int, subprocess.Popen[str]]]:
    """A 2-node job of ~80 steps (0.1 s each) with its metrics port; faults from the marker."""
    port = free_port()
    (tmp_path / "ckpt").mkdir()
    faults = getattr(request, "param", "")
    cmd = [
        *run_cmd("dlrover.cli.job"), "submit", "--name", "web", "--nnodes", "2",
        "--nproc-per-node", "1", "--metrics-port", str(port), str(SCRIPTS / "oracle_train.py"),
        "--steps", "80", "--step-time", "0.1", "--ckpt", str(tmp_path / "ckpt"),
        "--out", str(tmp_path / "out"),
    ]  # fmt: skip
    env = clean_env(DLROVER_HOME=str(tmp_path / "home"), DLROVER_FAULTS=faults)
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


def _until(what: str, check: object, timeout: float = 60.0) -> object:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = check()  # type: ignore[operator]
        except OSError as e:  # not up yet
            last = e
        else:
            if last:
                return last
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what} (last: {last!r})")


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="apt-get install prometheus")
def test_a_real_prometheus_scrapes_the_master(
    tmp_path: Path, job: tuple[int, subprocess.Popen[str]]
) -> None:
    port, _ = job
    web = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        f"  - job_name: dlrover\n    static_configs: [{{targets: ['127.0.0.1:{port}']}}]\n"
    )
    prom = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{web}",
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def query(expr: str) -> list[dict[str, object]]:
        url = f"http://127.0.0.1:{web}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())["data"]["result"]  # type: ignore[no-any-return]

    try:
        # Prometheus scraped the master while the job trained: steps rose, goodput is known.
        _until("steps in Prometheus", lambda: [r for r in query("dlrover_job_steps_total > 10")])
        up = query('up{job="dlrover"}')
        assert up and up[0]["value"][1] == "1", up  # type: ignore[index]
        ratio = float(query("dlrover_goodput_ratio")[0]["value"][1])  # type: ignore[index]
        assert 0.0 < ratio <= 1.0
        nodes = query('dlrover_nodes{state="running"}')
        assert nodes and nodes[0]["metric"]["job_name"] == "web"  # type: ignore[index]
        assert query("dlrover_badput_seconds_total") and query("dlrover_node_memory_bytes")
    finally:
        prom.terminate()
        prom.wait(10)


@pytest.mark.skipif(CHROMIUM is None, reason="apt-get install chromium")
@pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="pip install playwright")
@pytest.mark.parametrize("job", ["kill:rank=1:step=30"], indirect=True)
def test_the_dashboard_shows_the_nodes_and_a_killed_worker(
    tmp_path: Path, job: tuple[int, subprocess.Popen[str]]
) -> None:
    from playwright.sync_api import sync_playwright

    port, _ = job
    _until("the dashboard", lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2))
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ],  # fmt: skip
        )
        try:
            page = browser.new_page()
            page.goto(f"http://127.0.0.1:{port}/")
            page.wait_for_function(
                "document.querySelectorAll('#nodes tbody tr').length === 2", timeout=60_000
            )
            assert page.text_content("#job") == "web"
            # Rank 1's worker is SIGKILLed at step 30: the page, without a reload, shows the
            # failure in the timeline and a restart on a node.
            page.wait_for_function(
                "document.getElementById('events').textContent.includes('SIGKILL')",
                timeout=60_000,
            )
            # ... and the node's restart count once its next heartbeat told the master.
            page.wait_for_function(
                "[...document.querySelectorAll('#nodes tbody tr')]"
                ".some(r => Number(r.cells[6].textContent) >= 1)",
                timeout=20_000,
            )
            assert "%" in (page.text_content("#goodput") or "")
            page.select_option("#lognode", index=0)
            page.wait_for_function(
                "document.getElementById('log').textContent.includes('dlrover')", timeout=20_000
            )
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        finally:
            browser.close()


CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
SCREENSHOTS = os.environ.get("DLROVER_SCREENSHOTS", "")
"""Where the browser tests save their screenshots (scripts/dashboard_screenshots.sh points it at
docs/images); else the test's own temporary folder."""


CHARTS = "['chart-goodput', 'chart-throughput', 'chart-step', 'chart-memory', 'chart-cpu']"
POINTS = (
    "((id) => { const c = window.dlroverCharts[id]; if (!c) return 0;"
    " return c.plot.data.slice(1).flat().filter((v) => v != null).length; })"
)
"""The page's charts, and (JavaScript) the non-null points of one chart's series together."""


@pytest.mark.skipif(CHROMIUM is None, reason="apt-get install chromium")
@pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="pip install playwright")
def test_the_dashboards_chart_a_job_with_a_failure_and_checkpoints(tmp_path: Path) -> None:
    """`dlrover dashboard` lists the job while it runs and after it ended; the job's page charts
    samples/s, step time, goodput, memory and CPU per node live, with markers where a worker was
    killed and where checkpoints were persisted, and shows the same charts once the job ended."""
    from playwright.sync_api import sync_playwright

    shots = Path(SCREENSHOTS) if SCREENSHOTS else tmp_path
    shots.mkdir(parents=True, exist_ok=True)
    home = tmp_path / "home"
    env = clean_env(DLROVER_HOME=str(home), DLROVER_FAULTS="kill:rank=1:step=60")
    port = free_port()
    dashboard = subprocess.Popen(
        [*run_cmd("dlrover.cli.job"), "dashboard", "--port", str(port)],
        env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    err_path = tmp_path / "submit.err"
    with err_path.open("w") as err:
        job = subprocess.Popen(
            [
                *run_cmd("dlrover.cli.job"), "submit", "--name", "charts", "--nnodes", "2",
                "--nproc-per-node", "1", str(SCRIPTS / "flash_train.py"), "--steps", "160",
                "--step-time", "0.08", "--disk-every", "20", "--ckpt", str(tmp_path / "ckpt"),
                "--out", str(tmp_path / "out"),
            ],
            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, text=True,
        )  # fmt: skip
    try:
        assert dashboard.stdout is not None
        assert "http://" in dashboard.stdout.readline()  # it serves
        base = f"http://127.0.0.1:{port}"
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.goto(base + "/")
                page.wait_for_selector("tr[data-job='charts'] .state.running", timeout=60_000)
                page.click("tr[data-job='charts'] a")
                page.wait_for_url("**/jobs/charts/")
                page.wait_for_function("document.getElementById('job').textContent === 'charts'")
                # Live, without a reload: the kill's marker, then a persisted checkpoint's, on
                # every chart; each hover text says what happened.
                page.wait_for_function(
                    "document.querySelectorAll('#chart-step .marker[data-kind=failure]').length"
                    " && document.querySelectorAll('#chart-step .marker[data-kind=ckpt]').length",
                    timeout=60_000,
                )
                failure = page.get_attribute(
                    "#chart-throughput .marker[data-kind=failure]", "title"
                )
                assert failure is not None and "SIGKILL" in failure, failure
                ckpt = page.get_attribute("#chart-memory .marker[data-kind=ckpt]", "title")
                assert ckpt is not None and "committed to storage" in ckpt, ckpt
                # Each chart holds points (every node's series together), the throughput in
                # samples/s (the script reports its samples), one series per node.
                page.wait_for_function(f"{CHARTS}.every((id) => {POINTS}(id) >= 6)", timeout=60_000)
                title = page.text_content("#chart-throughput h3") or ""
                assert "samples/s" in title, title
                assert page.evaluate(
                    "window.dlroverCharts['chart-throughput'].plot.series.length"
                ) == 3  # fmt: skip
                page.screenshot(path=str(shots / "dashboard-job.png"), full_page=True)

                job.wait(timeout=120)
                assert job.returncode == 0, err_path.read_text()[-3000:]
                # Ended: the list says so, and the job's page charts what it left behind.
                page.goto(base + "/")
                page.wait_for_selector("tr[data-job='charts'] .state.succeeded", timeout=20_000)
                row = page.text_content("tr[data-job='charts']") or ""
                assert "%" in row and "local" in row, row
                page.screenshot(path=str(shots / "dashboard-jobs.png"), full_page=True)
                page.click("tr[data-job='charts'] a")
                page.wait_for_url("**/jobs/charts/")
                page.wait_for_function(
                    "document.getElementById('state').textContent === 'succeeded'"
                    " && window.dlroverCharts['chart-step']"
                    " && document.querySelectorAll('#chart-step .marker[data-kind=failure]').length",
                    timeout=20_000,
                )
                assert page.evaluate(f"{CHARTS}.every((id) => {POINTS}(id) >= 6)")
                page.screenshot(path=str(shots / "dashboard-ended.png"), full_page=True)
            finally:
                browser.close()
    finally:
        for proc in (job, dashboard):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
