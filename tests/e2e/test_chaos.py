"""Chaos: during a flash-checkpointed two-node job the master is SIGKILLed and restarted on its
state at random moments, and workers are killed at random steps too; the job ends normally and
its final model equals the failure-free run's, bit for bit.

The moments come from a seeded generator (DLROVER_CHAOS_SEED, default 7, printed on failure),
so a failing draw can be replayed.
"""

from __future__ import annotations

import os
import random
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, SCRIPTS, MasterProcess, clean_env, run_cmd

TRAIN = str(SCRIPTS / "flash_train.py")
TOKEN = "chaos-token"
STEPS = 36
SEED = int(os.environ.get("DLROVER_CHAOS_SEED", "7"))


def _done_steps(out: Path) -> list[int]:
    path = Path(f"{out}.steps")
    if not path.exists():
        return []
    return [int(x) for x in path.read_text().split("\n") if x and not x.startswith("resume")]


def _run(tmp: Path, name: str, chaos: random.Random | None) -> tuple[Path, list[str], str]:
    """One two-node job against a dlrover-master on a SQLite state; with ``chaos``, two worker
    kills and two master SIGKILL + restarts at drawn steps. Returns (out, node logs, what was
    drawn)."""
    root = tmp / name
    (root / "m0").mkdir(parents=True)
    (root / "ckpt").mkdir()
    state, out = str(root / "state.db"), root / "out"
    faults, master_kills, drawn = "", [], "no failures"
    if chaos is not None:
        (r1, r2), (s1, s2) = chaos.sample(range(4), 2), sorted(chaos.sample(range(4, STEPS - 4), 2))
        faults = (
            f"kill:rank={r1}:step={s1}:restart=*:once={root / 'k1'};"
            f"kill:rank={r2}:step={s2}:restart=*:once={root / 'k2'}"
        )
        master_kills = sorted(chaos.sample(range(3, STEPS - 3), 2))
        drawn = f"seed {SEED}: worker kills {faults!r}, master killed after steps {master_kills}"
    masters = [MasterProcess(root / "m0", "--state-db", state, "--token", TOKEN)]
    port = masters[0].vars["DLROVER_MASTER_ADDR"].rsplit(":", 1)[1]
    env = clean_env(**masters[0].vars, DLROVER_FAULTS=faults)
    cmd = [
        *run_cmd("dlrover.cli.run"),
        "--nnodes=2",
        "--nproc-per-node=2",
        "--max-restarts=3",
        TRAIN,
        "--steps",
        str(STEPS),
        "--disk-every",
        "5",
        "--ckpt",
        str(root / "ckpt"),
        "--out",
        str(out),
        "--step-time",
        "0.15",
    ]
    nodes = [
        subprocess.Popen(
            cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    try:
        for k, after in enumerate(master_kills, start=1):
            deadline = time.monotonic() + 120
            while not _done_steps(out) or max(_done_steps(out)) < after:
                assert all(p.poll() is None for p in nodes), f"a node ended early ({drawn})"
                assert time.monotonic() < deadline, f"no step {after} within 120 s ({drawn})"
                time.sleep(0.02)  # another process writes the file: nothing else to wait on
            masters[-1].proc.kill()
            masters[-1].wait(10)
            assert chaos is not None
            time.sleep(chaos.uniform(0.0, 1.5))  # the master stays dead a while
            (root / f"m{k}").mkdir()
            masters.append(
                MasterProcess(root / f"m{k}", "--state-db", state, "--token", TOKEN, "--port", port)
            )
        logs = [p.communicate(timeout=240)[0] for p in nodes]
        codes = [p.returncode for p in nodes]
        assert codes == [0, 0], f"nodes exited {codes} ({drawn})\n" + "\n\n".join(logs)
        last = masters[-1]
        assert last.wait(60) == 0, (
            f"({drawn})\n" + (root / f"m{len(masters) - 1}" / "master.log").read_text()
        )
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
        for m in masters:
            m.close()
    return out, logs, drawn


@pytest.mark.long
@pytest.mark.campaign
def test_random_master_and_worker_kills_leave_the_model_of_a_failure_free_run(tmp_path: Path):
    reference, _, _ = _run(tmp_path, "reference", None)
    chaos = random.Random(SEED)
    out, logs, drawn = _run(tmp_path, "chaos", chaos)
    assert (tmp_path / "chaos" / "k1").exists() and (tmp_path / "chaos" / "k2").exists(), drawn
    assert Path(f"{out}.final").read_text() == Path(f"{reference}.final").read_text(), drawn
    assert sorted(set(_done_steps(out))) == list(range(1, STEPS + 1)), drawn
    assert any("restart" in log for log in logs), drawn  # the worker kills were recovered from
