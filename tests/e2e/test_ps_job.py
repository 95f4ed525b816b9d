"""Jobs with embedding servers (`dlrover submit --ps N`): the master launches the `dlrover-ps`
nodes through the local engine, the workers find them through the master, `dlrover scale`
resizes them while the job trains, and a SIGKILLed server is replaced from its replica without
restarting a worker. The oracle: the model (dense weights and every embedding row) equals the
one of a run on two servers that nothing happened to."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, clean_env, dlrover_cli, run_cmd

pytestmark = pytest.mark.e2e

EXAMPLE = REPO / "examples" / "train_embedding.py"
STEPS = 240


def _args(tmp: Path, name: str, *flags: str, step_time: float = 0.0) -> list[str]:
    return [
        "submit", "--name", name, "--nproc-per-node", "1", *flags, str(EXAMPLE),
        "--steps", str(STEPS), "--step-time", str(step_time), "--out", str(tmp / name),
    ]  # fmt: skip


@pytest.fixture(scope="session")  # computed once per test process, whatever runs between
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The model of a run on two servers that nothing happened to."""
    tmp = tmp_path_factory.mktemp("ps-ref")
    r = dlrover_cli(tmp / "home", *_args(tmp, "ref", "--ps", "2"), timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return torch.load(tmp / "ref.pt")


class Job:
    """`dlrover submit` in the background, with its steps file and record."""

    def __init__(self, tmp: Path, name: str, *flags: str) -> None:
        self.tmp, self.name = tmp, name
        self.home = tmp / "home"
        self.log = open(tmp / f"{name}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*run_cmd("dlrover.cli.job"), *_args(tmp, name, *flags, step_time=0.04)],
            env=clean_env(DLROVER_HOME=str(self.home)),
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def step(self) -> int:
        path = self.tmp / f"{self.name}.steps"
        lines = path.read_text().splitlines() if path.exists() else []
        return int(lines[-1].split()[0]) if lines else 0

    def wait_step(self, step: int, timeout_s: float = 120) -> int:
        """Poll the steps file (another process writes it) until ``step``."""
        deadline = time.monotonic() + timeout_s
        while (now := self.step()) < step:
            assert self.proc.poll() is None, self.text()[-4000:]
            assert time.monotonic() < deadline, f"step {step} not reached: {self.text()[-4000:]}"
            time.sleep(0.05)
        return now

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return dlrover_cli(self.home, *args, timeout=300)

    def wait(self) -> int:
        code = self.proc.wait(300)
        self.log.close()
        return code

    def text(self) -> str:
        return (self.tmp / f"{self.name}.log").read_text()

    def metrics(self) -> str:
        record = json.loads((self.home / "jobs" / self.name / "job.json").read_text())
        from dlrover.client.master_client import MasterClient

        client = MasterClient(record["master_addr"], record["token"])
        try:
            port = client.get_job_status(with_nodes=False).metrics_port
        finally:
            client.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
            return str(page.read().decode())

    def restarts(self) -> set[str]:
        rows = (self.tmp / f"{self.name}.steps").read_text().splitlines()
        return {row.split()[2] for row in rows}


def _same_model(out: Path, ref: dict[str, torch.Tensor]) -> None:
    got = torch.load(f"{out}.pt")
    assert torch.equal(got["ids"], ref["ids"])
    assert torch.equal(got["deep"], ref["deep"]), "embedding rows differ"
    assert torch.equal(got["wide"], ref["wide"]), "embedding rows differ"
    for key, value in ref["mlp"].items():
        assert torch.equal(got["mlp"][key], value), key


def _until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_scaling_embedding_servers_two_three_two_mid_training_changes_nothing(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    job = Job(tmp_path, "grow", "--ps", "2")
    try:
        job.wait_step(40)
        up = job.cli("scale", "grow", "--role", "ps", "--count", "3")
        assert up.returncode == 0, up.stderr + job.text()[-4000:]
        assert re.search(
            r"3 embedding servers in [\d.]+s: \d+ buckets, [1-9]\d* rows moved", up.stdout
        )
        at_three = job.step()
        _until(lambda: 'server="2"' in job.metrics(), 30, "no metrics of the third server")
        status = job.cli("status", "grow").stdout
        assert re.search(r"ps 2\s+127\.0\.0\.1:\d+\s+[1-9]\d*", status), status
        # Each server's node too: its id, state, restarts, CPU and memory (MB).
        server = re.search(r"ps 2 .* grow-ps-2-0\s+running\s+0\s+\d+\s+(\d+)", status)
        assert server and int(server[1]) > 0, status
        assert re.search(
            r'dlrover_role_node_state\{[^}]*node="grow-ps-2-0",role="ps"', job.metrics()
        )
        rows = {
            m[1]: float(m[2])
            for m in re.finditer(
                r'dlrover_ps_rows\{[^}]*server="(\d)"[^}]*\} ([\d.e+]+)', job.metrics()
            )
        }
        assert sorted(rows) == ["0", "1", "2"] and all(v > 0 for v in rows.values()), rows
        job.wait_step(at_three + 40)
        down = job.cli("scale", "grow", "--role", "ps", "--count", "2")
        assert down.returncode == 0, down.stderr + job.text()[-4000:]
        assert job.step() < STEPS, "the scaling did not happen while the job trained"
        assert job.wait() == 0, job.text()[-4000:]
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    text = job.text()
    assert "embedding servers 2 -> 3" in text and "embedding servers 3 -> 2" in text
    assert job.restarts() == {"0"}  # no worker restarted
    _same_model(tmp_path / "grow", reference)


def test_a_killed_embedding_server_is_replaced_from_its_replica_without_a_worker_restart(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    job = Job(tmp_path, "kill", "--ps", "2", "--ps-replica", "sync")
    try:
        job.wait_step(60)
        pid = int(
            (job.home / "jobs" / "kill" / "nodes" / "kill-ps-1-0" / "pid").read_text().split()[0]
        )
        os.kill(pid, signal.SIGKILL)
        assert job.wait() == 0, job.text()[-4000:]
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    text = job.text()
    assert re.search(r"embedding server 1 \(kill-ps-1-0\) ended: launching kill-ps-1-1", text), (
        text[-4000:]
    )
    assert re.search(
        r"embedding server 1 replaced by 127\.0\.0\.1:\d+ in [\d.]+s: [1-9]\d* rows", text
    )
    assert job.restarts() == {"0"}  # the training loop waited and went on
    _same_model(tmp_path / "kill", reference)
    final = job.cli("status", "kill").stdout  # the ended job's: its replacement, relaunched
    assert re.search(r"^ps 1 .* kill-ps-1-1\s+\w+\s+1\s", final, re.MULTILINE), final
    diagnose = job.cli("diagnose", "kill")
    assert "kill-ps-1-0" in diagnose.stdout and "signal" in diagnose.stdout, diagnose.stdout


def test_scale_requests_that_cannot_be_done_are_refused_with_the_reason(tmp_path: Path) -> None:
    job = Job(tmp_path, "plain", "--ps", "1")
    try:
        job.wait_step(5)
        r = job.cli("scale", "plain", "--role", "worker", "--count", "2")
        assert r.returncode == 1 and "only ps (embedding servers) is scaled on request" in r.stderr
        r = job.cli("scale", "plain", "--role", "ps", "--count", "0")
        assert r.returncode == 1 and "keeps at least 1" in r.stderr
        job.cli("stop", "plain")
        job.wait()
    finally:
        if job.proc.poll() is None:
            job.proc.kill()


def test_a_restarted_master_takes_over_the_embedding_servers(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    """SIGKILL the master mid-training: `dlrover submit` starts it again on its state, it adopts
    the running servers (none relaunched, no worker restarted) and can still resize them."""
    job = Job(tmp_path, "mk", "--ps", "2")
    try:
        job.wait_step(30)
        record = job.home / "jobs" / "mk" / "job.json"
        master_pid = json.loads(record.read_text())["pid"]
        os.kill(master_pid, signal.SIGKILL)
        _until(lambda: "embedding servers resumed" in job.text(), 60, "no resumed servers")
        up = job.cli("scale", "mk", "--role", "ps", "--count", "3")
        assert up.returncode == 0, up.stderr + job.text()[-4000:]
        assert job.step() < STEPS, "the scaling did not happen while the job trained"
        assert job.wait() == 0, job.text()[-4000:]
    finally:
        if job.proc.poll() is None:
            job.proc.kill()
    nodes = sorted(p.name for p in (job.home / "jobs" / "mk" / "nodes").iterdir())
    assert nodes == ["mk-ps-0-0", "mk-ps-1-0", "mk-ps-2-0", "mk-worker-0-0"]
    assert job.restarts() == {"0"}
    _same_model(tmp_path / "mk", reference)
