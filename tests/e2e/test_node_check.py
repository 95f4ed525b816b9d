"""The pre-flight node check end to end: `dlrover submit --node-check` of 3 real nodes (agents,
check workers with real gloo groups) where one node is slow or its collective fails."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlrover.faults.throttle import QuotaThrottle
from tests.conftest import REPO, SCRIPTS, clean_env, dlrover_cli, dlrover_run
from tests.e2e.test_fault_tolerance import steps_log


def _submit(
    tmp: Path,
    name: str,
    faults: str,
    *flags: str,
    steps: int = 20,
    work: tuple[str, ...] = ("--step-time", "0.1"),
    nnodes: str = "3",
    **env: str,
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
            nnodes,
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
            *work,
        ],
        env=clean_env(DLROVER_HOME=str(tmp / "home"), DLROVER_FAULTS=faults, **env),
        cwd=REPO,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        text=True,
    )
    return job, log, tmp / name


def _end(job: subprocess.Popen[str], tmp: Path, name: str) -> None:
    """After a failed check: stop the job's nodes (`dlrover stop`), then `submit` itself."""
    if job.poll() is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            dlrover_cli(tmp / "home", "stop", name, "--timeout", "20", timeout=40)
        if job.poll() is None:
            job.kill()


def _status(tmp: Path, name: str) -> str:
    return dlrover_cli(tmp / "home", "status", name, timeout=30).stdout


def _checks(text: str) -> list[str]:
    """The master's verdict lines, in order."""
    return re.findall(
        r"dlrover\.master\.job: (node check of round \d+: \d+ nodes, \d+ check .*)", text
    )


@pytest.mark.e2e
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
        _end(job, tmp_path, "slow")
    text = log.read_text()
    checks = _checks(text)
    assert len(checks) >= 2, text[-6000:]  # the log says why a check is missing
    first, second = checks[:2]
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


@pytest.mark.long
@pytest.mark.e2e
def test_a_node_whose_collective_fails_is_localised_in_two_rounds(tmp_path: Path) -> None:
    job, log, out = _submit(tmp_path, "coll", "collective_fail:node=1", "--node-check", steps=10)
    try:
        assert job.wait(180) == 0, log.read_text()
    finally:
        _end(job, tmp_path, "coll")
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


@pytest.mark.long
@pytest.mark.e2e
def test_a_runtime_straggler_is_replaced_within_three_reports(tmp_path: Path) -> None:
    """No node check: node 1 turns out 3x slow while training. Its step times (reported with
    the heartbeats) score below 0.75 of the fastest node's (about 0.33 on an idle machine) in
    every report (every 2 s here); at the third report in a row it is replaced, and the job
    finishes on healthy nodes."""
    steps = 80
    job, log, out = _submit(
        tmp_path, "rt", "slow:node=1:factor=3", "--exclude-straggler", steps=steps,
        work=("--compute-ms", "100"), DLROVER_STRAGGLER_REPORT_S="2",
    )  # fmt: skip
    try:
        assert job.wait(240) == 0, log.read_text()
    finally:
        _end(job, tmp_path, "rt")
    text = log.read_text()
    reports = re.findall(r"straggler scores: (.*)", text)
    # About 0.33 alone; on a loaded machine the healthy nodes slow down too and node 1 scores
    # nearer the 0.75 bound, but below it: detected at the third low report, and replaced.
    scores = [re.search(r"rt-worker-1-0 (\d\.\d\d) \(", r) for r in reports]
    low = [r for r, s in zip(reports, scores, strict=True) if s and float(s.group(1)) < 0.75]
    assert len(low) == 3, "\n".join(reports)
    # Against the fastest node (1.00); a node whose first 10 s window is not measured yet is
    # not scored in that report.
    assert all(re.search(r"rt-worker-[02]-0 1\.00", r) for r in low), low
    warning = re.search(r"runtime straggler: node (\S+) scored below 0.75 .* in 3 reports", text)
    assert warning and warning.group(1) == "rt-worker-1-0", text
    assert "node rt-worker-1-0: replacing the straggler" in text
    assert "rt-worker-1-1" in home_nodes(tmp_path, "rt")
    assert [s for s, _, _ in steps_log(out)] == list(range(1, steps + 1))


@pytest.mark.e2e
@pytest.mark.parametrize("throttle", ["quota", "stop"])
def test_the_slow_fault_slows_the_worker_itself_and_runtime_scores_name_it(
    tmp_path: Path, throttle: str
) -> None:
    """2 nodes, ``slow:node=1:factor=3`` and no --exclude-straggler: node 1's agent throttles
    its worker (a CPU quota, or the SIGSTOP/SIGCONT cycle), the script never calls
    maybe_inject for it (under an agent the injector leaves slow faults out), and its CPU
    work per step takes about 3x as long: the runtime scores name node 1, the job keeps it,
    finishes every step, and `dlrover diagnose` lists the straggler."""
    if throttle == "quota" and QuotaThrottle.detect() is None:
        pytest.skip("no writable cgroup v1 cpu controller here")
    steps = 60
    job, log, out = _submit(
        tmp_path, "sl", "slow:node=1:factor=3", steps=steps, work=("--compute-ms", "100"),
        nnodes="2", DLROVER_STRAGGLER_REPORT_S="2", DLROVER_THROTTLE=throttle,
    )  # fmt: skip
    try:
        assert job.wait(420) == 0, log.read_text()
    finally:
        _end(job, tmp_path, "sl")
    text = log.read_text()
    kind = "cpu quota" if throttle == "quota" else "stop cycle"
    node1 = (tmp_path / "home" / "jobs" / "sl" / "nodes" / "sl-worker-1-0" / "stderr").read_text()
    # (the master ranks the nodes: node slot 1 may hold rank 0)
    assert re.search(rf"slow fault: rank \d \(pid \d+\) held to 1/3 of a CPU \({kind}\)", node1)
    warning = re.search(r"runtime straggler: node (\S+) scored below 0.75 .*; (.*)", text)
    assert warning and warning.groups() == ("sl-worker-1-0", "kept (no --exclude-straggler)")
    assert [s for s, _, _ in steps_log(out)] == list(range(1, steps + 1))
    rows = dlrover_cli(tmp_path / "home", "diagnose", "sl").stdout.splitlines()[2:]
    assert [r.split()[1:4] for r in rows] == [["sl-worker-1-0", "straggler", "none"]], rows
    # The throttle is gone with the job: no cgroup of it is left.
    assert not list(Path("/sys/fs/cgroup/cpu").glob("**/dlrover-slow-*"))


def test_bad_node_check_flags_are_refused(tmp_path: Path) -> None:
    r = dlrover_run(["--standalone", "--exclude-straggler", str(SCRIPTS / "oracle_train.py")])
    assert r.returncode == 2 and "--exclude-straggler needs --node-check" in r.stderr
    r = dlrover_run(["--standalone", "--node-check", "--straggler-ratio", "0.5", "x.py"])
    assert r.returncode == 2 and "--straggler-ratio 0.5: must be > 1" in r.stderr


def home_nodes(tmp: Path, name: str) -> list[str]:
    return sorted(p.name for p in (tmp / "home" / "jobs" / name / "nodes").iterdir())
