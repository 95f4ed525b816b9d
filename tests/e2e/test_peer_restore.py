"""A lost machine's replacement restores the flash checkpoint from its peer's memory
(DdpCheckpointer(..., replica_count=1)) instead of from storage, and the model is unchanged."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, SCRIPTS, clean_env
from tests.e2e.test_fault_tolerance import final


def _submit(tmp: Path, name: str, faults: str = "", replicas: int = 1) -> Path:
    """Two nodes x two workers of flash_train.py under `dlrover submit` (local engine)."""
    out = tmp / name
    r = subprocess.run(
        [
            sys.executable, "-m", "dlrover.cli.job", "submit", "--name", name, "--nnodes", "2",
            "--nproc-per-node", "2", "--max-restarts", "3", "--relaunch-delay", "0",
            str(SCRIPTS / "flash_train.py"), "--steps", "14", "--disk-every", "5",
            "--ckpt", str(tmp / f"{name}-ckpt"), "--out", str(out),
            "--replica-count", str(replicas), "--step-time", "0.05",
        ],
        env=clean_env(DLROVER_HOME=str(tmp / "home"), DLROVER_FAULTS=faults),
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if r.returncode != 0:
        for log in sorted((tmp / "home" / "jobs" / name / "nodes").glob("*/stderr")):
            print(f"==== {log}\n{log.read_text()[-4000:]}")
    assert r.returncode == 0, r.stdout + r.stderr
    return out


def _loads(out: Path) -> list[tuple[int, int, str, int]]:
    """(rank, first step, loaded from, peer node or -1) of every worker start."""
    rows = (line.split() for line in Path(f"{out}.loads").read_text().splitlines())
    return [(int(r), int(s), src, int(p)) for r, s, src, p in rows]


@pytest.mark.e2e
def test_a_lost_node_s_replacement_loads_the_step_from_its_peer_s_memory(tmp_path: Path) -> None:
    ref = _submit(tmp_path, "ref")
    marker = tmp_path / "fired"
    # Rank 2's node loses its machine at step 9: agent SIGKILLed, its shared memory deleted.
    # Step 8 was in memory only (storage holds step 5).
    lost = _submit(tmp_path, "lost", faults=f"lose_node:rank=2:step=9:once={marker}")
    assert marker.exists()
    assert final(lost) == final(ref)
    restarts = [row for row in _loads(lost) if row[1] != 1]
    assert len(restarts) == 4, _loads(lost)
    # Every rank resumed at step 9, from memory: storage was not read.
    assert {(first, source) for _, first, source, _ in restarts} == {(9, "memory")}
    # The replacement node's two ranks copied it from the other node; the survivor's did not.
    peers = sorted(peer for *_, peer in restarts)
    assert peers[:2] == [-1, -1] and peers[2] == peers[3] in (0, 1), restarts
    lines = Path(f"{lost}.steps").read_text().split("\n")
    steps = [int(x) for x in lines if x and not x.startswith("resume")]
    assert steps == list(range(1, 15))
    # Its agent copied the step in as the round formed, while the workers started.
    logs = "".join(p.read_text() for p in (tmp_path / "home/jobs/lost/nodes").glob("*/stderr"))
    assert "holds step 8 of this job's replicated state: copying it in" in logs, logs[-4000:]
    assert "copied step 8 of slot 0 from" in logs, logs[-4000:]


@pytest.mark.e2e
def test_without_replicas_the_replacement_makes_every_node_load_from_storage(
    tmp_path: Path,
) -> None:
    """The same loss with replica_count=0: the lost node's step 8 died with the machine, so no
    node can take it from memory, and every node loads one step from storage.

    Which step is a race the agents are meant to run: storage's step 5 when the new round
    reaches the surviving node first; step 8 when its own workers fail first, on the lost
    peer, and its agent persists its memory's newest step before the restart (persist on
    failure; a DDP step is whole in the one node that saves it). CI's load saw the second."""
    marker = tmp_path / "fired"
    lost = _submit(tmp_path, "lost", faults=f"lose_node:rank=2:step=9:once={marker}", replicas=0)
    restarts = [row for row in _loads(lost) if row[1] != 1]
    assert len(restarts) == 4, _loads(lost)
    loaded = {(first, source) for _, first, source, _ in restarts}
    assert loaded in ({(6, "storage")}, {(9, "storage")}), _loads(lost)
