"""`dlrover submit --auto-scale` without resources: the master measures the nodes' use, sizes
them, relaunches them at that size, and the job goes on to the failure-free result."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from dlrover.engines.cgroups import CgroupRoot
from tests.conftest import REPO, SCRIPTS, dlrover_cli
from tests.e2e.test_fault_tolerance import final, steps_log


def _submit(tmp: Path, name: str, *flags: str, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp / f"{name}-ckpt").mkdir()
    args = [
        "submit", "--name", name, "--nnodes", "2", "--nproc-per-node", "1", *flags,
        str(SCRIPTS / "oracle_train.py"), "--steps", "60", "--step-time", "0.1",
        "--ckpt", str(tmp / f"{name}-ckpt"), "--out", str(tmp / name),
    ]  # fmt: skip
    return dlrover_cli(tmp / "home", *args, timeout=300, **env)


@pytest.mark.long
@pytest.mark.e2e
def test_a_job_without_resources_is_sized_from_its_measured_use(tmp_path: Path) -> None:
    ref = _submit(tmp_path, "ref")
    assert ref.returncode == 0, ref.stderr
    r = _submit(
        tmp_path, "auto", "--auto-scale",
        DLROVER_AUTOSCALE_INTERVAL_S="1", DLROVER_AUTOSCALE_SIZING_S="3",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    plan = re.search(
        r"auto-scale: resize: measured peak (\d+) MiB and ([\d.]+) cores per node: "
        r"(\d+) MiB, ([\d.]+) CPU \(x1.3\)",
        r.stderr,
    )
    assert plan, r.stderr[-4000:]
    peak, cores, memory, cpu = int(plan[1]), float(plan[2]), int(plan[3]), float(plan[4])
    assert 100 < peak < 4000 and memory == -(-peak * 13 // 10)  # peak x 1.3, rounded up
    assert cpu >= max(0.5, (cores - 0.05) * 1.3) - 1e-9  # the log rounds cores to 0.1
    assert f"resizing 2 node(s) to {memory} MiB, {cpu:g} CPU" in r.stderr
    nodes = {p.name for p in (tmp_path / "home" / "jobs" / "auto" / "nodes").iterdir()}
    assert nodes >= {"auto-worker-0-0", "auto-worker-0-1", "auto-worker-1-0", "auto-worker-1-1"}
    if len(nodes) > 4:  # the peak grew after the sizing window: resized or OOM-relaunched bigger
        assert "auto-scale: resize: memory creeps to peak" in r.stderr or re.search(
            rf"OOM-killed with {memory} MiB; its replacement gets \d+ MiB", r.stderr
        ), r.stderr[-4000:]
    if CgroupRoot.detect()[0] is not None:
        assert "node resources are enforced" in r.stderr  # the resized nodes run limited
    assert final(tmp_path / "auto") == final(tmp_path / "ref")
    assert [s for s, _, _ in steps_log(tmp_path / "auto")] == list(range(1, 61))


def _elastic(
    tmp: Path,
    name: str,
    nnodes: str,
    flags: list[str],
    script: list[str],
    steps: int = 120,
    **env: str,
) -> Path:
    """examples/train_elastic.py (with ``script`` arguments) on ``nnodes`` nodes of one worker,
    submitted with ``flags``; returns its --out prefix."""
    out = tmp / name
    args = [
        "submit", "--name", name, "--nnodes", nnodes, "--nproc-per-node", "1",
        "--memory", "2Gi", "--cpu", "1", *flags,
        str(REPO / "examples" / "train_elastic.py"), "--steps", str(steps), "--global-batch", "12",
        "--ckpt", str(tmp / f"{name}-ckpt"), "--out", str(out), *script,
    ]  # fmt: skip
    r = dlrover_cli(tmp / "home", *args, timeout=400, **env)
    assert r.returncode == 0, r.stderr[-6000:]
    (tmp / f"{name}.log").write_text(r.stderr)
    return out


def _steps(out: Path) -> list[tuple[int, int]]:
    rows = (line.split() for line in Path(f"{out}.steps").read_text().splitlines())
    return [(int(s), int(w)) for s, w in rows]


def _same_model(a: Path, b: Path) -> None:
    import torch

    sa, sb = torch.load(f"{a}.pt"), torch.load(f"{b}.pt")
    for k in sa:  # the same samples per step; only the order of float sums differs
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-4, atol=1e-5)


FAST_PLANS = {
    "DLROVER_AUTOSCALE_INTERVAL_S": "1",
    "DLROVER_AUTOSCALE_COOLDOWN_S": "4",
    "DLROVER_AUTOSCALE_WINDOW_S": "3",
}


@pytest.mark.long
@pytest.mark.e2e
def test_a_job_whose_throughput_scales_goes_from_min_to_max_nodes(tmp_path: Path) -> None:
    """--nnodes 1:3 --auto-scale starts 1 node; each added node raises the step rate (the
    per-sample work splits over the workers), so the master adds nodes up to 3. ElasticTrainer
    keeps the global batch: the model equals a fixed one-node run's."""
    work = ["--sample-time", "0.02"]
    ref = _elastic(tmp_path, "ref", "1", [], work)
    auto = _elastic(tmp_path, "grow", "1:3", ["--auto-scale"], work, **FAST_PLANS)
    log = (tmp_path / "grow.log").read_text()
    assert "launching 1 nodes of job grow" in log
    assert "scaling from 1 to 2 nodes: first step from MIN" in log, log[-4000:]
    assert re.search(r"scaling from 2 to 3 nodes: node 2 added \+\d+%", log), log[-4000:]
    # A later plan on a loaded machine may measure the third node's gain under the threshold
    # and give it back (CI once: "node 3 added +9%"); it must say so. What this test holds is
    # the climb from MIN to MAX, and the model.
    for line in re.findall(r"scaling from 3 to 2 nodes: .*", log):
        assert re.match(r"scaling from 3 to 2 nodes: node 3 added \+?-?\d+%", line), line
    steps = _steps(auto)
    worlds = [w for _, w in steps]
    climb = worlds[: worlds.index(3) + 1] if 3 in worlds else worlds
    assert worlds[0] == 1 and climb[-1] == 3 and climb == sorted(climb), worlds
    assert {s for s, _ in steps} == set(range(1, 121))  # every step done (some again on resume)
    _same_model(auto, ref)


@pytest.mark.long
@pytest.mark.e2e
def test_a_node_that_adds_nothing_is_given_back(tmp_path: Path) -> None:
    """A job whose step is a serial part (no per-sample work) gains nothing from a second
    node: the master tries it, sees no speed-up twice in a row, and goes back to 1 node. The
    gain is 0 give or take the machine's noise, so the rates are measured over 12 s windows (a
    step is heard with a heartbeat, up to 2 s late at either end of a window; 3 s ones, on a
    loaded machine, once made one node look 15% slower than two), and the serial
    part is 0.5 s a step: the one-node rate is measured once, early, and a machine busier then
    (another test's nodes starting) added ~0.04 s to each step's own work; at 0.1 s a step that
    made two nodes look 30-55% faster for the rest of the job (no verdict in 108 s, 3 runs of 3
    beside tests/e2e/test_node_check.py), at 0.5 s it is under the 10% a vote allows."""
    work = ["--sample-time", "0", "--serial-time", "0.5"]
    plans = {**FAST_PLANS, "DLROVER_AUTOSCALE_WINDOW_S": "12"}
    auto = _elastic(tmp_path, "flat", "1:2", ["--auto-scale"], work, steps=160, **plans)
    log = (tmp_path / "flat.log").read_text()
    assert "scaling from 1 to 2 nodes: first step from MIN" in log, log[-4000:]
    assert re.search(
        r"scaling from 2 to 1 nodes: node 2 added [+-]\d+% \([\d.]+ -> [\d.]+ steps/s\), 2 plans",
        log,
    ), log
    worlds = [w for _, w in _steps(auto)]
    assert worlds[0] == 1 and 2 in worlds and worlds[-1] == 1, worlds
