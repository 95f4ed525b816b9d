"""The master survives its own death: SIGKILLed mid-job and restarted on the same address and
state, it resumes the job; agents re-attach, workers never restart, everyone exits 0."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, SCRIPTS, MasterProcess, clean_env, redis_missing, run_cmd
from tests.stalls import end_all, until

ORACLE = str(SCRIPTS / "oracle_train.py")
TOKEN = "restart-token"


def _steps(out: Path) -> list[tuple[int, int]]:
    path = Path(str(out) + ".steps")
    if not path.exists():
        return []
    return [
        (int(s), int(w))
        for s, w, _ in (line.split() for line in path.read_text().split("\n") if line)
    ]


class _Node(subprocess.Popen[str]):
    """A ``dlrover-run`` node whose output goes to the file ``log``: a pipe that nobody reads
    while the test waits would fill and stall the node."""

    def __init__(self, args: list[str], log: Path, **kwargs: Any) -> None:
        self.log = log
        with log.open("w") as f:
            super().__init__(args, stdout=f, stderr=subprocess.STDOUT, text=True, **kwargs)

    def said(self) -> str:
        return self.log.read_text()


def _until(condition, what: str, procs: list[_Node], timeout: float = 120) -> None:
    def said() -> str:
        return "the nodes said:\n" + "\n\n".join(p.said()[-3000:] for p in procs)

    until(condition, what, procs, timeout, every_s=0.05, said=said)


def _node(ckpt: Path, out: Path, steps: int, env: dict[str, str], *extra: str) -> _Node:
    return _Node(
        [
            *run_cmd("dlrover.cli.run"),
            "--nnodes=2",
            "--nproc-per-node=2",
            ORACLE,
            "--steps",
            str(steps),
            "--ckpt",
            str(ckpt),
            "--out",
            str(out),
            "--step-time",
            "0.1",
            *extra,
        ],
        out.parent / f"node-{time.monotonic_ns()}.log",
        env=env,
        cwd=REPO,
    )


REDIS = pytest.param(
    "mid-training-on-redis",
    marks=[pytest.mark.extras, pytest.mark.skipif(bool(redis_missing()), reason=redis_missing())],
)


@pytest.mark.parametrize(
    "moment",
    [
        *(
            pytest.param(moment, marks=pytest.mark.e2e)
            for moment in ("mid-training", "during-rendezvous", "at-exit-barrier")
        ),
        REDIS,
    ],
)
def test_a_killed_master_restarted_on_its_state_resumes_the_job(
    tmp_path: Path, moment: str, request: pytest.FixtureRequest
):
    state = str(tmp_path / "state.db")
    if moment == "mid-training-on-redis":  # the new master could run on any machine
        state = request.getfixturevalue("redis_server").url + "?prefix=restart"
    first = MasterProcess(tmp_path, "--state-db", state, "--token", TOKEN)
    port = first.vars["DLROVER_MASTER_ADDR"].rsplit(":", 1)[1]
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    ckpt.mkdir()
    steps = 40
    env = clean_env(**first.vars)
    # At the exit barrier: the workers of node rank 1 (ranks 2, 3) take 8 s to exit after
    # training, so node rank 0 waits at the barrier meanwhile, and the master dies under it.
    linger = ("--linger-from-rank", "2", "--linger-s", "8") if moment == "at-exit-barrier" else ()
    nodes: list[_Node] = []
    again = None
    logs: list[str] = []
    try:  # whatever fails below, the nodes and masters are stopped (finally)
        nodes.append(_node(ckpt, out, steps, env, *linger))
        if moment == "at-exit-barrier":
            nodes.append(_node(ckpt, out, steps, env, *linger))
            log = tmp_path / "master.log"
            _until(
                lambda: "running -> succeeded" in log.read_text(), "a node at the barrier", nodes
            )
        elif moment != "during-rendezvous":
            nodes.append(_node(ckpt, out, steps, env))
            _until(lambda: len(_steps(out)) >= 5, "step 5", nodes)
        else:  # one node waits in round 1 for the other when the master dies
            log = tmp_path / "master.log"
            _until(lambda: "joins round 1" in log.read_text(), "the first join", nodes)
        first.proc.kill()  # SIGKILL: no goodbye, no flush beyond what the store made durable
        first.wait(10)
        (tmp_path / "again").mkdir()
        again = MasterProcess(
            tmp_path / "again", "--state-db", state, "--token", TOKEN, "--port", port
        )
        if moment == "during-rendezvous":
            nodes.append(_node(ckpt, out, steps, env))
        for p in nodes:
            p.wait(120)
        logs = [p.said() for p in nodes]
        if [p.returncode for p in nodes] != [0, 0]:
            print("\n\n".join(logs))
        assert [p.returncode for p in nodes] == [0, 0]
        assert again.wait(60) == 0, (tmp_path / "again" / "master.log").read_text()
    finally:
        end_all(nodes)
        first.close()
        if again is not None:
            again.close()
    assert _steps(out) == [(s, 4) for s in range(1, steps + 1)]  # every step once, world intact
    for log_text in logs:  # the workers ran through the master's death: started once, never again
        assert log_text.count("started 2 workers") == 1, log_text
    assert "succeeded" in (tmp_path / "again" / "master.log").read_text()
    if moment == "at-exit-barrier":  # the first node's held barrier call died with the master
        assert any("exit barrier: the master does not answer" in t for t in logs), logs
