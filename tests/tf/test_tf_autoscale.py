"""TensorFlow parameter-server jobs scaled from measured load, with real TensorFlow processes on
the local engine: workers added while samples/s grows, a third ps for a hot ps of a skewed
table, and a ps whose memory creeps to its limit resized before the OOM kill. Each submits the
Wide & Deep example with `auto_scale` and short plan intervals; the oracle is every sample id
trained once (a variable on the ps counts them) and the plans in `dlrover status` (and, for the
resize, the ps' own cgroup read while the job runs)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dlrover.engines.cgroups import CgroupRoot
from tests.conftest import REPO, clean_env, dlrover_cli, run_cmd

pytestmark = [
    pytest.mark.extras,
    pytest.mark.skipif(
        importlib.util.find_spec("tensorflow") is None,
        reason="TensorFlow is not installed: pip install tensorflow-cpu==2.21.0",
    ),
]

EXAMPLE = REPO / "examples" / "tf_ps" / "wide_deep.py"


def _submit(
    tmp_path: Path,
    name: str,
    args: list[str],
    roles: dict[str, Any],
    watch: Callable[[], None] = lambda: None,
    **env: str,
) -> tuple[Path, str]:
    """`dlrover submit` the example as job ``name`` with ``auto_scale`` (``watch`` is called
    every 0.2 s while it runs); asserts it ended 0 and every sample was trained once; returns
    its DLROVER_HOME and its final `dlrover status`."""
    out = tmp_path / name
    spec = {
        "name": name,
        "distribution_strategy": "ParameterServerStrategy",
        "entrypoint": str(EXAMPLE),
        "args": ["--out", str(out), *args],
        "roles": roles,
        "auto_scale": True,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(spec))
    home = tmp_path / "home"
    log = tmp_path / f"{name}.log"
    with open(log, "w") as output:
        submitted = subprocess.Popen(
            [*run_cmd("dlrover.cli.job"), "submit", str(path)],
            env=clean_env(DLROVER_HOME=str(home), **env),
            cwd=REPO,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 300
        while submitted.poll() is None:
            if time.monotonic() > deadline:
                submitted.kill()
                submitted.wait()
                pytest.fail(f"job {name} did not end within 300 s: {log.read_text()[-4000:]}")
            watch()
            with contextlib.suppress(subprocess.TimeoutExpired):
                submitted.wait(timeout=0.2)
    assert submitted.returncode == 0, log.read_text()[-4000:]
    with np.load(out / "model.npz") as model:
        assert (model["seen"] == 1).all(), np.flatnonzero(model["seen"] != 1)[:20]
    return home, dlrover_cli(home, "status", name).stdout


def test_a_job_started_with_one_worker_adds_one_while_it_raises_samples_per_second(
    tmp_path: Path,
) -> None:
    limit = {"resources": {"memory": "2Gi"}}  # sized: nothing to measure before scaling
    # 0.1 s of worker time per batch of 200: one worker trains ~2,000 samples/s, two ~4,000.
    args = ["--step-time", "0.1", "--shard-size", "1000", "--checkpoint-every", "1"]
    roles = {"chief": limit, "ps": limit, "worker": {"count": 1, "max_count": 2, **limit}}
    _, final = _submit(
        tmp_path,
        "scaled",
        args,
        roles,
        DLROVER_AUTOSCALE_INTERVAL_S="1",
        DLROVER_AUTOSCALE_WINDOW_S="2",
        DLROVER_AUTOSCALE_COOLDOWN_S="0",
    )
    report = json.loads((tmp_path / "scaled" / "report.json").read_text())
    assert report["workers"] == 2 and report["eval_loss"] < 0.55, report
    # The second worker joined the chief's running strategy: no checkpoint, no restart.
    grown = [(r["kind"], r["what"], r["restored"]) for r in report["recoveries"]]
    assert grown == [("grow", "worker 1 -> 2", grown[0][2])], report["recoveries"]
    assert report["recoveries"][0]["pause_s"] < 2.0, report["recoveries"]
    assert re.search(r"scale_out worker 1 -> 2: first step from MIN", final), final
    assert re.search(r"^scaled-worker-1-0 +worker +1 ", final, re.M), final


def test_a_hot_ps_of_a_skewed_table_is_named_and_a_third_ps_splits_its_part(
    tmp_path: Path,
) -> None:
    limit = {"resources": {"memory": "2Gi"}}
    # Every row in the first half of a wide table: the ps holding it serves all lookups.
    # Long enough for two plans in a row to find the ps hot on a loaded machine (CI ran out of
    # training at 120,000 samples once, with another TensorFlow job beside it).
    args = ["--size", "240000", "--skew", "--dim", "1024"]
    roles = {"chief": limit, "ps": {"count": 2, "max_count": 3, **limit}, "worker": limit}
    plans: list[str] = []
    asked = [0.0]

    def watch() -> None:  # the status's plan line while the job runs, every 2 s
        if time.monotonic() - asked[0] < 2.0:
            return
        asked[0] = time.monotonic()
        status = dlrover_cli(tmp_path / "home", "status", "hot").stdout
        plans.extend(line for line in status.splitlines() if line.startswith("auto-scale:"))

    home, final = _submit(
        tmp_path,
        "hot",
        args,
        roles,
        watch,
        DLROVER_AUTOSCALE_INTERVAL_S="1",
        DLROVER_TF_USAGE_INTERVAL_S="0.5",
    )
    report = json.loads((tmp_path / "hot" / "report.json").read_text())
    # That a re-partition from 2 to 3 ps keeps what the model learnt is
    # test_tf_ps_job.py's test of `dlrover scale` (against the failure-free run); here the
    # subject is the hot ps: named, relieved by a third, and learning goes on.
    assert report["ps"] == 3 and report["eval_loss"] < 0.55, report
    assert [r["what"] for r in report["recoveries"]] == ["ps 2 -> 3"], report["recoveries"]
    assert re.search(r"scale_out ps 2 -> 3: ps \d \(hot-ps-\d-0\) is hot: [\d.]+ cores", final), (
        final
    )
    diagnose = dlrover_cli(home, "diagnose", "hot").stdout
    assert "is hot" in diagnose and "no failures recorded" in diagnose, diagnose
    # Relieved by load: after the re-partition (the table split finer, its shards placed on
    # the ps in turn) no ps carries 1.5x the others' mean, and none is called hot again.
    after = plans[next(i for i, p in enumerate(plans) if "scale_out ps 2 -> 3" in p) + 1 :]
    even = [p for p in after if p.startswith("auto-scale: ps load even")]
    assert even and not any("is hot" in p for p in after[after.index(even[0]) :]), plans
    # Judged at the busiest sample: the last ones may fall in the job's wind-down, where the
    # workers are finishing and the ps' loads drop unevenly (seen once in CI: 0.07, 0.17, 0.07).
    loads = [[float(x) for x in re.findall(r"[\d.]+", p.split("(", 1)[1])] for p in even]
    cores = max(loads, key=sum)
    assert len(cores) == 3, even
    for i, mine in enumerate(cores):
        others = [c for j, c in enumerate(cores) if j != i]
        assert mine <= 1.5 * max(sum(others) / len(others), 0.05), "\n".join(plans)


@pytest.mark.skipif(
    CgroupRoot.detect()[0] is None, reason="no cgroup can be made here for a memory limit"
)
def test_a_ps_whose_memory_creeps_to_its_limit_is_resized_in_place_before_any_oom_kill(
    tmp_path: Path,
) -> None:
    root = CgroupRoot.detect()[0]
    assert root is not None
    seen: list[tuple[int | None, set[int]]] = []
    """The ps' cgroup limit and its processes, read while the job runs."""

    def watch() -> None:
        node = root.existing("creep-ps-0-0")
        if node is None:
            return
        with contextlib.suppress(OSError, ValueError):  # the node is starting or ending
            procs = {int(p) for p in (node.dirs[0] / "cgroup.procs").read_text().split()}
            seen.append((node.memory_limit_bytes(), procs))

    limit = {"resources": {"memory": "2Gi"}}
    # 4 MiB more on the ps per shard: ~600 MiB at the start, past 810 (90%) within 60 shards.
    args = ["--size", "120000", "--grow-mb", "4", "--shard-delay", "0.2"]
    roles = {"chief": limit, "ps": {"resources": {"memory": "900Mi"}}, "worker": limit}
    _, final = _submit(
        tmp_path,
        "creep",
        args,
        roles,
        watch,
        DLROVER_AUTOSCALE_INTERVAL_S="1",
        DLROVER_TF_USAGE_INTERVAL_S="1",
    )
    # Each resize in place, by limit: (used, limit, new limit) in MiB. A slow machine runs the
    # job long enough for the ps to creep past 90% of its new limit too: a second resize.
    resizes: list[tuple[int, int, int]] = []
    for found in re.findall(
        r"resize ps: ps 0 \(creep-ps-0-0\) memory creeps to (\d+) of (\d+) MiB: (\d+) MiB "
        r"\(x1\.3\): resized in place",
        final,
    ):
        resize = (int(found[0]), int(found[1]), int(found[2]))
        if resize not in resizes:
            resizes.append(resize)
    resizes.sort(key=lambda resize: resize[1])  # the status names the newest first, then all
    assert resizes and resizes[0][1] == 900 and resizes[0][0] > 810, final
    for (_, _, grown), (_, limit, _) in zip(resizes, resizes[1:], strict=False):
        assert limit == grown, resizes  # each from the limit the one before set
    # The same attempt (never relaunched), at the new limit, and its pid is the one that served
    # under 900 MiB and after the resize.
    row = re.search(r"^creep-ps-0-0 +ps +0 +\S+ +-1 +0 +\d+ +\d+ +(\d+) +(\d+) ", final, re.M)
    assert row and int(row.group(1)) == resizes[-1][2], final
    pid = int(row.group(2))
    # A sample taken while the node was starting saw its cgroup before the ps joined it.
    before = [procs for mib, procs in seen if mib == 900 << 20 and procs]
    grown_to = {new << 20 for _, _, new in resizes}
    after = [procs for mib, procs in seen if mib in grown_to and procs]
    assert before and after, sorted({mib for mib, _ in seen}, key=str)
    assert pid in before[0] and pid in after[-1], (pid, before[0], after[-1])
    assert "failures: none" in final, final  # no OOM kill
    report = json.loads((tmp_path / "creep" / "report.json").read_text())
    assert report["eval_loss"] < 0.55, report
