"""The pre-flight node check end to end: `dlrover submit --node-check` of 3 real nodes (agents,
check workers with real gloo groups) where one node is slow or its collective fails."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO, SCRIPTS, clean_env, dlrover_cli, dlrover_run
from tests.e2e.test_fault_tolerance import steps_log


def _submit(
    tmp: Path, name: str, faults: str, *flags: str, steps: int = 20, **env: str
) -> tuple[subprocess.Popen[str], Path, Path]:
    (tmp / f"{name}-ckpt").mkdir()
    log = tmp / f"{name}.log"
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dlrover.cli.job",
            "submit",
            "--name",
            name,
            "--nnodes",
            "3",
            "--nproc-per-node",
            "1",
            *flags,
            str(SCRIPTS / "oracle_train.py"),
            "--steps",
            str(steps),
            "--ckpt",
            str(tmp / f"{name}-ckpt"),
            "--out",
            str(tmp / name),
            "--step-time",
            "0.1",
        ],
        env=clean_env(DLROVER_HOME=str(tmp / "home"), DLROVER_FAULTS=faults, **env),
        cwd=REPO,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        text=True,
    )
    return job, log, tmp / name


def _status(tmp: Path, name: str) -> str:
    return dlrover_cli(tmp / "home", "status", name, timeout=30).stdout


def _checks(text: str) -> list[str]:
    """The master's verdict lines, in order."""
    return re.findall(
        r"dlrover\.master\.job: (node check of round \d+: \d+ nodes, \d+ check .*)", text
    )


def test_a_slow_node_is_named_by_the_check_and_replaced(tmp_path: Path) -> None:
    steps = 30
    job, log, out = _submit(
        tmp_path, "slow", "slow:node=1:factor=3", "--node-check", "--exclude-straggler", steps=steps
    )
    try:
        # While the job trains, `dlrover status` shows the check's verdict and each node's word.
        deadline = time.monotonic() + 120
        status = ""
        while "all healthy" not in status or " ok " not in status:
            assert job.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"no check in dlrover status:\n{status}"
            time.sleep(0.5)
            if (tmp_path / "home" / "jobs" / "slow" / "job.json").exists():
                status = _status(tmp_path, "slow")
        assert job.wait(120) == 0, log.read_text()
    finally:
        if job.poll() is None:
            job.kill()
    text = log.read_text()
    first, second = _checks(text)[:2]
    # The first check names node 1 a straggler (about 3x) and excludes it ...
    assert re.search(
        r"stragglers: slow-worker-1-0 \([23]\.\d+x\); excluded: slow-worker-1-0$", first
    )
    # ... the engine replaces it, and the next round's check (with the replacement) is clean.
    assert "relaunch_node" in text and "all healthy" in second
    nodes = home_nodes(tmp_path, "slow")
    assert nodes == ["slow-worker-0-0", "slow-worker-1-0", "slow-worker-1-1", "slow-worker-2-0"]
    excluded = tmp_path / "home" / "jobs" / "slow" / "nodes" / "slow-worker-1-0" / "stderr"
    assert "the node check excluded this node: straggler" in excluded.read_text()
    assert "started 1 workers" not in excluded.read_text()  # it never trained
    assert [s for s, _, _ in steps_log(out)] == list(range(1, steps + 1))
    # Budget: the check of healthy nodes takes well under 10 s here.
    seconds = float(re.search(r"check round\(s\), ([\d.]+)s", second).group(1))  # type: ignore[union-attr]
    assert seconds < 10, second


def test_a_node_whose_collective_fails_is_localised_in_two_rounds(tmp_path: Path) -> None:
    job, log, out = _submit(tmp_path, "coll", "collective_fail:node=1", "--node-check", steps=10)
    try:
        assert job.wait(180) == 0, log.read_text()
    finally:
        if job.poll() is None:
            job.kill()
    text = log.read_text()
    first = _checks(text)[0]
    assert "3 nodes, 2 check round(s)" in first, first
    assert re.search(
        r"faulty: coll-worker-1-0 \(failed the node check: collective test failed: "
        r"injected fault\); excluded: coll-worker-1-0$",
        first,
    ), first
    assert "all healthy" in _checks(text)[1]  # the replacement passes
    assert home_nodes(tmp_path, "coll") == [
        "coll-worker-0-0",
        "coll-worker-1-0",
        "coll-worker-1-1",
        "coll-worker-2-0",
    ]
    assert [s for s, _, _ in steps_log(out)] == list(range(1, 11))


def test_a_runtime_straggler_is_replaced_within_three_reports(tmp_path: Path) -> None:
    """No node check: node 1 turns out 3x slow while training. Its step times (reported with
    the heartbeats) score about 0.33 of the fastest node's in every report (every 2 s here); at
    the third report in a row it is replaced, and the job finishes on healthy nodes."""
    steps = 80
    job, log, out = _submit(
        tmp_path, "rt", "slow:node=1:factor=3", "--exclude-straggler", steps=steps,
        DLROVER_STRAGGLER_REPORT_S="2",
    )  # fmt: skip
    try:
        assert job.wait(240) == 0, log.read_text()
    finally:
        if job.poll() is None:
            job.kill()
    text = log.read_text()
    reports = re.findall(r"straggler scores: (.*)", text)
    low = [r for r in reports if re.search(r"rt-worker-1-0 0\.[0-4]\d \(", r)]
    assert len(low) == 3, reports  # detected at the third low report, and replaced
    # Against the fastest node (1.00); a node whose first 10 s window is not measured yet is
    # not scored in that report.
    assert all(re.search(r"rt-worker-[02]-0 1\.00", r) for r in low), low
    warning = re.search(r"runtime straggler: node (\S+) scored below 0.75 .* in 3 reports", text)
    assert warning and warning.group(1) == "rt-worker-1-0", text
    assert "node rt-worker-1-0: replacing the straggler" in text
    assert "rt-worker-1-1" in home_nodes(tmp_path, "rt")
    assert [s for s, _, _ in steps_log(out)] == list(range(1, steps + 1))


def test_bad_node_check_flags_are_refused(tmp_path: Path) -> None:
    r = dlrover_run(["--standalone", "--exclude-straggler", str(SCRIPTS / "oracle_train.py")])
    assert r.returncode == 2 and "--exclude-straggler needs --node-check" in r.stderr
    r = dlrover_run(["--standalone", "--node-check", "--straggler-ratio", "0.5", "x.py"])
    assert r.returncode == 2 and "--straggler-ratio 0.5: must be > 1" in r.stderr


def home_nodes(tmp: Path, name: str) -> list[str]:
    return sorted(p.name for p in (tmp / "home" / "jobs" / name / "nodes").iterdir())
