"""`dlrover diagnose`: real jobs with injected failures, and what the master recorded of them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, SCRIPTS, clean_env, dlrover_cli


def _submit(
    tmp: Path,
    name: str,
    faults: str,
    nnodes: str,
    cgroup: Path | None = None,
    nproc: str = "2",
    expect: int = 0,
) -> str:
    (tmp / f"{name}-ckpt").mkdir()

    def enter_cgroup() -> None:  # runs in the child: it and all it starts count against the limit
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))

    r = subprocess.run(
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
            nproc,
            "--max-restarts",
            "3",
            str(SCRIPTS / "oracle_train.py"),
            "--steps",
            "12",
            "--ckpt",
            str(tmp / f"{name}-ckpt"),
            "--out",
            str(tmp / name),
        ],  # fmt: skip
        env=clean_env(DLROVER_HOME=str(tmp / "home"), DLROVER_FAULTS=faults),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=enter_cgroup if cgroup is not None else None,
    )
    assert (r.returncode == 0) == (expect == 0), r.stderr[-5000:]
    return r.stderr


def _diagnose(tmp: Path, name: str, *flags: str) -> list[list[str]]:
    r = dlrover_cli(tmp / "home", "diagnose", name, *flags)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1].split()[:4] == ["time", "node", "class", "action"]
    return [line.split(None, 4) for line in lines[2:] if not line.startswith("    ")]


@pytest.mark.e2e
def test_diagnose_lists_each_failure_with_its_class_and_action(tmp_path: Path) -> None:
    """A worker raises (user error: restart in place), then a node's agent is SIGKILLed (the
    node is relaunched). After the job ended, `dlrover diagnose` reads them from the state."""
    marker = tmp_path / "fired"
    # restart=*: the raise at step 3 restarts the workers of both nodes before step 6, and
    # whether the other node's restart counts (its workers died of the broken collective) or
    # not (its agent saw the new round first) is a race.
    faults = f"raise:rank=1:step=3;kill_agent:rank=2:step=6:restart=*:once={marker}"
    _submit(tmp_path, "dg", faults, "2")
    rows = _diagnose(tmp_path, "dg")
    # The raised exception is one row (the other node's workers may record the broken
    # collective it caused too, before or after it).
    raised = [r for r in rows if "InjectedFault: injected fault at step 3" in r[4]]
    assert len(raised) == 1, rows
    assert (raised[0][2], raised[0][3]) == ("user_error", "restart_processes"), rows
    assert raised[0][4].startswith("rank 1 exit code 1: dlrover.testing.faults.InjectedFault")
    # The node holding global rank 2 (whichever the master ranked second) lost its agent: the
    # one relaunch. (The other node's workers may die of the broken collective meanwhile and
    # be restarted in place: user_error or signal rows with restart_processes.)
    lost = [r for r in rows if r[3] == "relaunch_node"]
    assert len(lost) == 1 and lost[0][2] == "signal" and "killed by SIGKILL" in lost[0][4], rows
    assert all(r[3] == "restart_processes" for r in rows if r is not lost[0]), rows
    # The other node's broken collective, where recorded, is classed collateral.
    assert {r[2] for r in rows} <= {"user_error", "signal", "collateral"}, rows
    full = dlrover_cli(tmp_path / "home", "diagnose", "dg", "--full").stdout
    assert 'File "' in full and "maybe_inject" in full  # the traceback of the user error
    missing = dlrover_cli(tmp_path / "home", "diagnose", "nope")
    assert missing.returncode == 1 and "no job named 'nope'" in missing.stderr


@pytest.mark.e2e
def test_an_error_repeated_behind_other_nodes_collateral_errors_fails_fast_naming_it(
    tmp_path: Path,
) -> None:
    """issue 51, item 5 (benchmarks/fault_campaign.py --seed 23 job 1): a 3-node job whose rank
    1 raises the same exception on every attempt while its teardown lingers, so the other
    nodes' agents see their broken collectives, and the master re-forms the world, before its
    own agent sees the exit. The job fails fast on the second occurrence, naming the exception,
    not a healthy node's collateral error; those are classed collateral; no budget runs out."""
    r = subprocess.run(
        [
            sys.executable, "-m", "dlrover.cli.job", "submit", "--name", "rc", "--nnodes", "3",
            "--nproc-per-node", "1", "--max-restarts", "3",
            str(SCRIPTS / "raise_and_linger.py"), "--rank", "1", "--step", "6",
        ],
        env=clean_env(DLROVER_HOME=str(tmp_path / "home")),
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode != 0, r.stderr[-3000:]
    record = json.loads((tmp_path / "home" / "jobs" / "rc" / "job.json").read_text())
    reason = record["reason"]
    assert record["state"] == "failed", record
    assert "twice in a row" in reason and "ValueError: bad batch at step 6" in reason, reason
    assert "Connection closed" not in reason and "budget exhausted" not in reason, reason
    rows = _diagnose(tmp_path, "rc")
    raised = [r for r in rows if "ValueError: bad batch at step 6" in r[4]]
    assert len(raised) == 2, rows  # it failed on the second occurrence
    assert [r[2] for r in raised] == ["user_error", "user_error"], rows
    assert raised[-1][3] == "fail", rows
    # The healthy nodes' broken collectives: recorded, classed collateral, never the cause.
    others = [r for r in rows if r not in raised]
    assert others and all(r[2] == "collateral" for r in others), rows


def _memory_cgroup(limit_bytes: int) -> Path | None:
    """A fresh child of this process's cgroup v1 memory cgroup with a limit, or None."""
    from dlrover.agent.cgroup import memory_cgroup_files

    for path in memory_cgroup_files():
        if path.name != "memory.oom_control":
            continue
        child = path.parent / f"dlrover-test-{os.getpid()}"
        try:
            child.mkdir()
            (child / "memory.limit_in_bytes").write_text(str(limit_bytes))
            swap = child / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(limit_bytes))  # no swapping out of the OOM
        except OSError:
            if child.exists():
                child.rmdir()
            continue
        return child
    return None


@pytest.fixture
def memory_limit() -> Iterator[Path]:
    cgroup = _memory_cgroup(3 << 30)
    if cgroup is None:
        pytest.skip("no writable cgroup v1 memory controller here (needs root in a VM/container)")
    try:
        yield cgroup
    finally:
        for _ in range(50):
            try:
                cgroup.rmdir()
                break
            except OSError:  # its last processes are still exiting
                import time

                time.sleep(0.1)


@pytest.mark.e2e
def test_a_worker_killed_by_the_oom_killer_is_classified_oom(
    tmp_path: Path, memory_limit: Path
) -> None:
    """The job runs in a memory cgroup limited to 3 GiB; rank 1 allocates until the kernel's
    OOM killer ends it. The agent sees its SIGKILL and the cgroup's oom_kill counter go up:
    class oom, restarted in place, and the job ends normally."""
    _submit(tmp_path, "oom", "oom:rank=1:step=3", "1", cgroup=memory_limit)
    rows = _diagnose(tmp_path, "oom")
    assert [(r[2], r[3]) for r in rows] == [("oom", "restart_processes")], rows
    # The victim is the kernel's choice: rank 1's hog, almost always; once, while other test
    # runs loaded the machine, rank 0. The report must name the rank that was killed.
    assert re.search(r"rank [01] OOM-killed", rows[0][4]), rows


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("hang_timeout", "step"),
    [("3", 5), ("min=3", 60)],  # fixed; learned (after 10 steps; the agent sees them every 1 s)
    ids=["fixed", "learned"],
)
def test_a_hang_names_the_rank_that_did_not_enter_the_collective(
    tmp_path: Path, hang_timeout: str, step: int
) -> None:
    """issue 51, item 4: on two nodes, rank 1 skips an all-reduce and blocks in its own code;
    rank 0 waits in it. The hang is found (a fixed --hang-timeout: by both nodes; a learned
    one: by rank 1's node, while rank 0's, seeing it wait in a collective, tells the master what
    it waits in), both ranks' flight recorders are read, and `dlrover diagnose` names rank 1,
    the collective rank 0 waits in, and rank 1's stack; the dashboard's timeline says the same.
    The job then recovers and succeeds."""
    r = subprocess.run(
        [
            sys.executable, "-m", "dlrover.cli.job", "submit", "--name", "lag", "--nnodes", "2",
            "--nproc-per-node", "1", "--max-restarts", "2", "--hang-timeout", hang_timeout,
            str(SCRIPTS / "skip_collective.py"), "--rank", "1", "--step", str(step),
            "--steps", str(step + 7), "--once", str(tmp_path / "skipped"),
        ],
        env=clean_env(DLROVER_HOME=str(tmp_path / "home")),
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    out = dlrover_cli(tmp_path / "home", "diagnose", "lag").stdout
    assert "hang" in out and "class" in out, out
    hang = out[out.index("\nhang") :]
    assert re.search(
        r"rank 1 did not enter gloo:all_reduce #\d+ of process group \S+ that rank 0 waits? in",
        hang,
    ), out
    assert "rank 1's stack:" in hang and "wait_for_something_that_never_comes" in hang, out
    # Rank 0 is not blamed: it is the one waiting.
    assert "rank 0 did not enter" not in hang, out
    history = json.loads((tmp_path / "home" / "jobs" / "lag" / "history.json").read_text())
    said = [m["text"] for m in history["markers"] if m["kind"] == "hang"]
    assert any("rank 1 did not enter gloo:all_reduce" in t for t in said), history["markers"]
