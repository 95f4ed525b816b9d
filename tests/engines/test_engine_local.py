"""Local engine with real subprocesses: exit reporting, kill + replacement, no orphans."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from dlrover.engines.base import (
    FailureReason,
    NodeEvent,
    NodeNotFoundError,
    NodeSpec,
    NodeState,
    wait_for_event,
)
from dlrover.engines.local import LocalEngine

# A node of a tiny "job": wait for the go file, sum the squares of its share of 0..N-1, write
# the partial sum atomically. The job's result is the sum of all partials.
NODE_SCRIPT = """
import os, sys, time
rank, nnodes, n, workdir = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
open(os.path.join(workdir, f"started-{rank}-{os.environ['ATTEMPT']}"), "w").close()
deadline = time.monotonic() + 30
while not os.path.exists(os.path.join(workdir, "go")):
    if time.monotonic() > deadline:
        sys.exit(7)
    time.sleep(0.01)
total = sum(i * i for i in range(rank, n, nnodes))
tmp = os.path.join(workdir, f"part-{rank}.tmp")
with open(tmp, "w") as f:
    f.write(str(total))
os.replace(tmp, os.path.join(workdir, f"part-{rank}"))
"""


def _spec(rank: int, command: list[str], attempt: int = 0) -> NodeSpec:
    return NodeSpec(
        job_name="localjob",
        rank=rank,
        relaunch_count=attempt,
        command=tuple(command),
        env={"ATTEMPT": str(attempt)},
    )


def _wait_for_file(path: Path, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout}s"
        time.sleep(0.01)


def _final(event: NodeEvent) -> bool:
    return event.state.is_final


def test_exit_code_signal_and_success_are_reported(tmp_path: Path) -> None:
    with LocalEngine(tmp_path / "logs", stop_grace_s=1.0) as engine:
        engine.launch(_spec(0, [sys.executable, "-c", "pass"]))
        engine.launch(_spec(1, [sys.executable, "-c", "import sys; sys.exit(3)"]))
        engine.launch(
            _spec(
                2, [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
            )
        )
        seen: list[NodeEvent] = []
        finals: dict[int, NodeEvent] = {}
        while len(finals) < 3:
            wait_for_event(engine, _final, 15.0, seen)
            # One drain may bring several final events: count them all, not just the match.
            finals.update({e.spec.rank: e for e in seen if e.state.is_final})
    assert finals[0].state is NodeState.SUCCEEDED and finals[0].exit_code == 0
    assert finals[1].state is NodeState.FAILED
    assert (finals[1].reason, finals[1].exit_code) == (FailureReason.EXIT_CODE, 3)
    assert finals[2].state is NodeState.FAILED
    assert (finals[2].reason, finals[2].signal) == (FailureReason.SIGNAL, signal.SIGKILL)
    running = [e for e in seen if e.state is NodeState.RUNNING]
    assert {e.spec.rank for e in running} <= {0, 1, 2}


def test_killed_node_is_replaced_and_job_result_is_correct(tmp_path: Path) -> None:
    nnodes, n = 2, 10_000
    workdir = tmp_path / "work"
    workdir.mkdir()

    def command(rank: int) -> list[str]:
        return [sys.executable, "-c", NODE_SCRIPT, str(rank), str(nnodes), str(n), str(workdir)]

    with LocalEngine(tmp_path / "logs", stop_grace_s=1.0) as engine:
        nodes = engine.launch_many([_spec(rank, command(rank)) for rank in range(nnodes)])
        assert [node.spec.rank for node in nodes] == [0, 1]
        for rank in range(nnodes):
            _wait_for_file(workdir / f"started-{rank}-0")

        os.kill(engine.pid("localjob-worker-1-0"), signal.SIGKILL)
        seen: list[NodeEvent] = []
        lost = wait_for_event(engine, _final, 15.0, seen)
        assert lost.node_id == "localjob-worker-1-0"
        assert (lost.state, lost.reason, lost.signal) == (
            NodeState.FAILED,
            FailureReason.SIGNAL,
            signal.SIGKILL,
        )

        replacement = engine.launch(_spec(1, command(1), attempt=lost.spec.relaunch_count + 1))
        assert replacement.node_id == "localjob-worker-1-1"
        _wait_for_file(workdir / "started-1-1")
        (workdir / "go").touch()

        # wait_for_event keeps every event it drained in `seen`, also those after the match in
        # the same batch: both ends may arrive together, so look at all of them.
        def finals() -> dict[str, NodeEvent]:
            return {e.node_id: e for e in seen if _final(e) and e.node_id != lost.node_id}

        while set(finals()) != {"localjob-worker-0-0", "localjob-worker-1-1"}:
            wait_for_event(engine, _final, 15.0, seen)
        assert {e.state for e in finals().values()} == {NodeState.SUCCEEDED}, finals()
    result = sum(int((workdir / f"part-{rank}").read_text()) for rank in range(nnodes))
    assert result == sum(i * i for i in range(n))


CHILD_SCRIPT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
if sys.argv[2] == "exit":
    sys.exit(5)
time.sleep(120)
"""


def _read_pid(path: Path) -> int:
    deadline = time.monotonic() + 15
    while True:
        text = path.read_text() if path.exists() else ""
        if text:
            return int(text)
        assert time.monotonic() < deadline, f"{path} was never written"
        time.sleep(0.01)


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.02)
    return False


def test_close_leaves_no_orphans_even_when_sigterm_is_ignored(tmp_path: Path) -> None:
    ignore_term = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + CHILD_SCRIPT
    engine = LocalEngine(tmp_path / "logs", stop_grace_s=0.5)
    engine.launch(_spec(0, [sys.executable, "-c", ignore_term, str(tmp_path / "c0"), "stay"]))
    engine.launch(_spec(1, [sys.executable, "-c", CHILD_SCRIPT, str(tmp_path / "c1"), "stay"]))
    children = [_read_pid(tmp_path / "c0"), _read_pid(tmp_path / "c1")]
    leaders = [engine.pid("localjob-worker-0-0"), engine.pid("localjob-worker-1-0")]
    started = time.monotonic()
    engine.close()
    assert time.monotonic() - started < 5.0
    assert all(_gone(pid) for pid in children + leaders)
    finals = engine.events(0)
    assert [e.state for e in finals if e.state.is_final] == [NodeState.DELETED] * 2


def test_children_of_a_dead_node_are_killed(tmp_path: Path) -> None:
    with LocalEngine(tmp_path / "logs", stop_grace_s=0.5) as engine:
        engine.launch(_spec(0, [sys.executable, "-c", CHILD_SCRIPT, str(tmp_path / "c"), "exit"]))
        child = _read_pid(tmp_path / "c")
        event = wait_for_event(engine, _final, 15.0)
        assert (event.reason, event.exit_code) == (FailureReason.EXIT_CODE, 5)
        assert _gone(child)


def test_delete_is_idempotent_and_reports_deleted(tmp_path: Path) -> None:
    with LocalEngine(tmp_path / "logs", stop_grace_s=0.5) as engine:
        node = engine.launch(_spec(0, [sys.executable, "-c", "import time; time.sleep(60)"]))
        again = engine.launch(node.spec)  # same node id: no second process
        assert again.node_id == node.node_id and len(engine.list_nodes()) == 1
        engine.delete(node.node_id)
        event = wait_for_event(engine, _final, 5.0)
        assert (event.node_id, event.state, event.reason) == (node.node_id, NodeState.DELETED, None)
        engine.delete(node.node_id)
        with pytest.raises(NodeNotFoundError):
            engine.delete("localjob-worker-9-0")
        assert [n.state for n in engine.list_nodes()] == [NodeState.DELETED]


def test_command_not_found_is_a_launch_error(tmp_path: Path) -> None:
    from dlrover.engines.base import LaunchError

    with LocalEngine(tmp_path / "logs") as engine, pytest.raises(LaunchError, match="no-such"):
        engine.launch(_spec(0, ["/no-such-dir/no-such-binary"]))


ADOPTABLE = """
import os, sys, time
workdir = sys.argv[1]
open(os.path.join(workdir, "started"), "a").write("x")
deadline = time.monotonic() + 30
while not os.path.exists(os.path.join(workdir, "go")):
    assert time.monotonic() < deadline
    time.sleep(0.01)
with open(os.environ["DLROVER_NODE_EXIT_FILE"], "w") as f:  # what dlrover-run does at its end
    f.write("3")
sys.exit(3)
"""


def test_a_new_engine_adopts_a_node_that_outlived_the_old_one(tmp_path: Path) -> None:
    """The master that launched a node dies; the engine of its successor launches the same node
    id: it adopts the running process (no second start) and reports its real exit code."""
    spec = _spec(0, [sys.executable, "-c", ADOPTABLE, str(tmp_path)])
    first = LocalEngine(tmp_path / "logs")
    pid = first.launch(spec) and first.pid(spec.node_id)
    _wait_for_file(tmp_path / "started")
    first.close(delete_nodes=False)  # as if its master were SIGKILLed: the node lives on

    second = LocalEngine(tmp_path / "logs")
    try:
        node = second.launch(spec)
        assert node.state is NodeState.RUNNING and second.pid(spec.node_id) == pid
        assert (tmp_path / "started").read_text() == "x"  # started once
        (tmp_path / "go").touch()
        ended = wait_for_event(second, _final, 30)
        assert (ended.state, ended.reason, ended.exit_code) == (
            NodeState.FAILED,
            FailureReason.EXIT_CODE,
            3,
        )
        # Its pid file now names a dead process: a later launch starts the node afresh.
        third = LocalEngine(tmp_path / "logs")
        try:
            assert third.launch(spec) and third.pid(spec.node_id) != pid
            deadline = time.monotonic() + 15
            while (tmp_path / "started").read_text() != "xx":  # the fresh process starts once
                assert time.monotonic() < deadline, (tmp_path / "started").read_text()
                time.sleep(0.01)
        finally:
            third.close()
    finally:
        second.close()
