"""`dlrover logs` and `dlrover status` of a job on a real local Ray cluster: per-rank logs are
read by the node actors on their machines and served by the master's dashboard."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, SCRIPTS, clean_env, dlrover_cli
from tests.engines.test_engine_ray import ray_cluster  # noqa: F401 - the fixture

pytestmark = [
    pytest.mark.extras,
    pytest.mark.xdist_group("ray"),  # one local Ray cluster at a time (.ci/run: -n 2)
    pytest.mark.skipif(
        importlib.util.find_spec("ray") is None,
        reason="ray is not installed (pip install 'dlrover[ray]')",
    ),
]


@pytest.mark.timeout(300)
def test_ray_nodes_per_rank_logs_on_the_dashboard_and_from_dlrover_logs(
    ray_cluster: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    home, out = tmp_path / "home", tmp_path / "out"
    out.mkdir()
    spec = {
        "name": "raylogs",
        "entrypoint": str(SCRIPTS / "chatty.py"),
        "args": [str(out), "100000", "0.1"],
        "nodes": 2,
        "nproc_per_node": 2,
        "resources": {"cpu": 1},
        "engine": "ray",
        "engine_settings": {"address": ray_cluster.address},
    }
    path = tmp_path / "raylogs.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    log_path = tmp_path / "submit.log"
    log = open(log_path, "w")  # noqa: SIM115 - a pipe nobody reads would block it
    job = subprocess.Popen(
        [sys.executable, "-m", "dlrover.cli.job", "submit", str(path)],
        env=clean_env(DLROVER_HOME=str(home)),
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 180
        while True:  # every rank has printed a few steps, and its log shows them
            assert job.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            if (home / "jobs" / "raylogs" / "job.json").exists():
                r = dlrover_cli(home, "logs", "raylogs", "-n", "3")
                if r.returncode == 0 and all(
                    f"chatty rank={k} attempt=0 step=" in r.stdout for k in range(4)
                ):
                    break
            time.sleep(0.5)  # the job's state is in other processes: polling, bounded above
        status = dlrover_cli(home, "status", "raylogs").stdout
        assert status.splitlines()[2].startswith("ray actor"), status  # nodes are actors
        actors = [line.split()[0] for line in status.splitlines() if "raylogs-worker-" in line]
        assert sorted(actors) == ["raylogs-worker-0-0", "raylogs-worker-1-0"]

        # One rank's log holds that script's own lines only.
        r = dlrover_cli(home, "logs", "raylogs", "--rank", "1", "-n", "4")
        assert r.returncode == 0, r.stderr
        lines = [line for line in r.stdout.splitlines() if line.strip()]
        assert lines and all(line.startswith("chatty rank=1 ") for line in lines), r.stdout
        # A node's own log is its agent's.
        own = dlrover_cli(home, "logs", "raylogs", "--node", actors[0]).stdout
        assert "dlrover.agent" in own and "chatty rank=" not in own
        bad = dlrover_cli(home, "logs", "raylogs", "--rank", "8")
        assert bad.returncode == 1 and "ranks with logs: 0, 1, 2, 3" in bad.stderr

        # The dashboard serves the same.
        port = int(status.split("dashboard: http://", 1)[1].split(":")[1].split("/")[0])
        base = f"http://127.0.0.1:{port}"
        ranks = {
            a: json.loads(urllib.request.urlopen(f"{base}/api/log/ranks?node={a}").read())
            for a in actors
        }
        assert sorted(r for rs in ranks.values() for r in rs) == [0, 1, 2, 3]
        holder = next(a for a, rs in ranks.items() if 3 in rs)
        page = urllib.request.urlopen(f"{base}/api/log?node={holder}&rank=3&lines=5").read()
        assert page.decode().startswith("chatty rank=3 ")

        # -f follows new lines until the job ends.
        follower = subprocess.Popen(
            [sys.executable, "-m", "dlrover.cli.job", "logs", "raylogs", "--rank", "0", "-f"],
            env=clean_env(DLROVER_HOME=str(home)),
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert follower.stdout is not None
        steps: list[int] = []
        while len(steps) < 3:
            line = follower.stdout.readline()
            assert line, "the follower ended before the job"
            if " step=" in line:
                steps.append(int(line.rsplit("=", 1)[1]))
        assert steps == sorted(steps) and len(set(steps)) == 3
        stopped = dlrover_cli(home, "stop", "raylogs", "--timeout", "120", timeout=150)
        assert stopped.returncode == 0, stopped.stderr
        assert follower.wait(60) == 0
        job.wait(60)
        # Once the actors are gone, so are their logs: said plainly.
        gone = dlrover_cli(home, "logs", "raylogs")
        assert gone.returncode == 1 and "which are gone" in gone.stderr
        assert "ray actor" in dlrover_cli(home, "status", "raylogs").stdout  # the final table
    finally:
        if job.poll() is None:
            job.send_signal(signal.SIGTERM)
            try:
                job.wait(30)
            except subprocess.TimeoutExpired:
                job.kill()
        log.close()
