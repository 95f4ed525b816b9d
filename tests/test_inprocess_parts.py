"""The parts of in-process recovery one at a time: the channel's messages, the launch plan of
a node that goes on without a failed local rank, the agent's hub, and the wrapper in a real
worker process driven through the hub (no job: the test plays the agent)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dlrover.agent.config import AgentConfig
from dlrover.agent.launch_plan import AttemptContext, plan_launch
from dlrover.agent.recovery_hub import RecoveryHub
from dlrover.api.master import CommWorld, FailureClass, FailureRecord
from dlrover.cli.status_view import failure_lines, recovery_line
from dlrover.json_messages import MessageError
from dlrover.recovery_channel import (
    Abort,
    Hello,
    NewRound,
    Parked,
    decode_agent_message,
    decode_worker_message,
    encode_message,
    env_changes,
)
from tests.conftest import REPO, clean_env


def test_messages_round_trip_and_a_bad_line_names_what_is_wrong() -> None:
    for message in (Hello(1, 42, shrink=True), Parked(0, "peer closed")):
        assert decode_worker_message(encode_message(message)) == message
    for reply in (Abort("rank 1 failed", at_step_end=True), NewRound(3, {"RANK": "0"})):
        assert decode_agent_message(encode_message(reply)) == reply
    with pytest.raises(MessageError, match="unknown kind"):
        decode_worker_message(b'{"kind": "bye"}\n')
    with pytest.raises(MessageError, match="pid"):
        decode_worker_message(b'{"kind": "hello", "local_rank": 0, "pid": "x"}\n')


def test_env_changes_set_what_differs_and_clear_what_is_gone() -> None:
    before = {"RANK": "1", "WORLD_SIZE": "2", "DLROVER_RECOVERY_JOIN": "1", "PATH": "/bin"}
    after = {"RANK": "0", "WORLD_SIZE": "2", "PATH": "/bin", "MASTER_PORT": "5"}
    assert env_changes(before, after) == {
        "RANK": "0",
        "MASTER_PORT": "5",
        "DLROVER_RECOVERY_JOIN": "",
    }


def test_status_counts_the_job_s_recoveries_by_kind() -> None:
    def failure(action: str) -> FailureRecord:
        return FailureRecord(0.0, "n0", FailureClass.SIGNAL, action, "rank 1 signal SIGKILL", 1)

    assert recovery_line(()) == ""
    actions = ["recover_in_process", "restart_processes", "recover_in_process", "fail"]
    assert recovery_line(tuple(map(failure, actions))) == (
        "recoveries: 2 in-process (survivors kept their processes), 1 restart in place "
        "(dlrover diagnose lists each)"
    )


def test_diagnose_says_what_each_failure_cost() -> None:
    record = FailureRecord(
        0.0, "n0", FailureClass.SIGNAL, "recover_in_process", "rank 1 signal SIGKILL", 1, 3, 0.42
    )
    line = failure_lines((record,))[1]
    assert line.endswith("rank 1 signal SIGKILL  (-> round 3, back 0.4s after)"), line


def _plan(active: set[int] | None, node_rank: int = 1):
    config = AgentConfig(entrypoint=["python", "t.py"], nproc_per_node=4, max_nodes=2)
    world = CommWorld(
        round=3,
        complete=True,
        num_nodes=2,
        node_rank=node_rank,
        world_size=4 + (len(active) if active is not None else 4),
        rank_offset=4 if node_rank == 1 else 0,
        store_host="127.0.0.1",
        store_port=1234,
    )
    ctx = AttemptContext("job", "n1", 1, 0, "/tmp/run", "127.0.0.1:1", "t", 7, None, "/tmp/r.sock")
    return plan_launch(config, world, ctx, {}, active)


def test_a_node_going_on_without_failed_ranks_numbers_the_others_and_hands_out_their_data() -> None:
    plan = _plan({0, 3})
    assert plan.active == {0, 3}
    env = [launch.env for launch in plan.launches]
    # The members: ranks after the other node's 4, local indexes 0 and 1, the failed ranks'
    # data (full layout ranks 5 and 6) spread over them; LOCAL_RANK (the device) kept.
    assert [env[lr]["RANK"] for lr in (0, 3)] == ["4", "5"]
    assert [env[lr]["LOCAL_RANK"] for lr in (0, 3)] == ["0", "3"]
    assert [env[lr]["LOCAL_WORLD_SIZE"] for lr in (0, 3)] == ["2", "2"]
    assert [env[lr]["DLROVER_LOCAL_INDEX"] for lr in (0, 3)] == ["0", "1"]
    assert env[0]["DLROVER_VIRTUAL_RANKS"] == "4,5"
    assert env[3]["DLROVER_VIRTUAL_RANKS"] == "6,7"
    assert {e["DLROVER_VIRTUAL_WORLD_SIZE"] for e in env} == {"8"}
    assert env[0]["WORLD_SIZE"] == "6"
    # The replacements wait to join, in their full-layout place.
    for lr in (1, 2):
        assert env[lr]["DLROVER_RECOVERY_JOIN"] == "1"
        assert env[lr]["RANK"] == str(4 + lr)
    assert "DLROVER_RECOVERY_JOIN" not in env[0]

    full = _plan(None)
    assert [launch.env["RANK"] for launch in full.launches] == ["4", "5", "6", "7"]
    assert [launch.env["DLROVER_VIRTUAL_RANKS"] for launch in full.launches] == [
        "4",
        "5",
        "6",
        "7",
    ]
    assert all("DLROVER_RECOVERY_JOIN" not in launch.env for launch in full.launches)


def test_the_hub_knows_who_opted_in_and_drops_a_worker_whose_link_ends(tmp_path: Path) -> None:
    import socket

    hub = RecoveryHub(str(tmp_path / "r.sock"))
    try:
        links = []
        for lr, pid in ((0, 100), (1, 101)):
            s = socket.socket(socket.AF_UNIX)
            s.connect(hub.path)
            s.sendall(encode_message(Hello(lr, pid, shrink=lr == 0)))
            links.append(s)
        assert hub.wait_parked([0, 1], 0.0) == set()
        deadline = 50
        while not hub.opted_in({0: 100, 1: 101}) and deadline:
            deadline -= 1
            hub.wait_parked([0], 0.02)  # a bounded wait for the reader threads
        assert hub.opted_in({0: 100, 1: 101})
        assert not hub.opted_in({0: 999})  # another process in that slot
        assert hub.shrink([0]) and not hub.shrink([0, 1])
        links[1].sendall(encode_message(Parked(1, "peer closed")))
        assert hub.wait_parked([1], 5.0) == {1}
        assert hub.parked_unasked() == {1: "peer closed"}
        links[0].close()
        while hub.opted_in({0: 100}) and deadline:
            deadline -= 1
            hub.wait_parked([0], 0.02)
        assert not hub.opted_in({0: 100})
    finally:
        hub.close()


WORKER = textwrap.dedent(
    """
    import os, sys, time
    from dlrover.trainer import StepReporter
    from dlrover.trainer.torch.inprocess import Wrapper, recoveries, data_share

    reporter = StepReporter()
    log = open(sys.argv[1], "a", buffering=1)

    @Wrapper(shrink=True, step_end_timeout_s=30)
    def train():
        log.write(f"enter {os.getpid()} {os.environ['RANK']} {recoveries()} {data_share().ranks}\\n")
        if recoveries() == 1:
            return "done"
        for step in range(100000):
            reporter.report(step)
            time.sleep(0.01)

    print(train(), flush=True)
    """
)


def test_a_wrapped_function_leaves_at_a_step_end_and_enters_again_in_the_same_process(
    tmp_path: Path,
) -> None:
    """The test plays the agent: it asks the worker to leave at the end of a step, waits for
    it to park, and hands it a round; the function runs again in the same process with the
    round's environment."""
    hub = RecoveryHub(str(tmp_path / "r.sock"))
    log = tmp_path / "log"
    env = clean_env(
        DLROVER_RECOVERY_SOCKET=hub.path,
        RANK="1",
        LOCAL_RANK="0",
        WORLD_SIZE="2",
        DLROVER_STEP_FILE=str(tmp_path / "step"),
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(log)],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(3000):  # at most 60 s: the worker imports torch first
            if hub.opted_in({0: proc.pid}):
                break
            assert proc.poll() is None, "the worker exited"
            hub.wait_parked([0], 0.02)
        assert hub.opted_in({0: proc.pid}) and hub.shrink([0])
        hub.abort([0], "a peer failed", at_step_end=True)
        assert hub.wait_parked([0], 30.0) == {0}
        assert hub.send_round(
            0, 2, {"RANK": "0", "WORLD_SIZE": "1", "DLROVER_VIRTUAL_RANKS": "0,1"}
        )
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        hub.close()
    assert proc.returncode == 0
    assert out.strip() == "done"
    lines = log.read_text().splitlines()
    assert lines == [f"enter {proc.pid} 1 0 (1,)", f"enter {proc.pid} 0 1 (0, 1)"]
    assert not os.path.exists(hub.path)
