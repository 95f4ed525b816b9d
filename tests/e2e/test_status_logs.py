"""`dlrover status` process ids and an ended job's table, `dlrover logs` (local engine): a real
job from `dlrover submit`, the CLI called as a user would."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, SCRIPTS, clean_env, dlrover_cli, run_cmd

dlrover = dlrover_cli

ROW = re.compile(r"^(chat-worker-\d-\d)\s+(-?\d+)\s+(\w+)\s+.*\s(\d+)\s+([\d,]+|-)\s*$")


def rows(status: str) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Node id -> (agent pid, worker pids) from `dlrover status`'s table."""
    found = {}
    for line in status.splitlines():
        m = ROW.match(line)
        if m:
            workers = tuple(int(p) for p in m.group(5).split(",")) if m.group(5) != "-" else ()
            found[m.group(1)] = (int(m.group(4)), workers)
    return found


def pid_files(out: Path) -> dict[int, int]:
    """Rank -> the pid its current attempt wrote."""
    return {
        int(p.name.split(".")[1]): int(p.read_text().split()[0])
        for p in out.glob("pid.*")
        if p.read_text().strip()
    }


def live_and_descended(agent: int, workers: tuple[int, ...]) -> bool:
    """Whether the agent and each worker are alive (os.kill 0) and the workers descend from it."""
    try:
        os.kill(agent, 0)
        for pid in workers:
            os.kill(pid, 0)
            if agent not in {p.pid for p in psutil.Process(pid).parents()}:
                return False
    except (ProcessLookupError, psutil.NoSuchProcess):
        return False
    return True


def lines_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _terminal_sigint() -> None:
    """In the child before exec: SIGINT as a terminal's process gets it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.mark.e2e
def test_status_shows_live_pids_logs_follow_and_an_ended_jobs_table(tmp_path: Path):
    home, out = tmp_path / "home", tmp_path / "out"
    out.mkdir()
    log = open(tmp_path / "submit.log", "w")  # noqa: SIM115 - a pipe nobody reads would block it
    # Rank 1 SIGKILLs itself at step 3 of its first attempt: a failure, restarted in place.
    job = subprocess.Popen(
        [*run_cmd("dlrover.cli.job"), "submit", "--name", "chat", "--nnodes", "2",
         "--nproc-per-node", "2", str(SCRIPTS / "chatty.py"), str(out), "100000", "0.1", "1", "3"],
        env=clean_env(DLROVER_HOME=str(home)), cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    follower: subprocess.Popen[str] | None = None
    try:
        # 1. The table names every live process: agents and workers, as the workers wrote them.
        deadline = time.monotonic() + 120
        while True:
            assert job.poll() is None, (tmp_path / "submit.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "submit.log").read_text()[-3000:]
            status = (
                dlrover(home, "status", "chat").stdout
                if (home / "jobs" / "chat" / "job.json").exists()
                else ""
            )
            table, written = rows(status), pid_files(out)
            shown = {p for _, workers in table.values() for p in workers}
            restarted = "restarts" in status and any(
                int(line.split()[4]) >= 1 for line in status.splitlines() if ROW.match(line)
            )
            if (
                restarted
                and len(table) == 2
                and len(written) == 4
                and shown == set(written.values())
                and all(live_and_descended(agent, workers) for agent, workers in table.values())
            ):
                break  # the restart settled: every process shown is the live one
            time.sleep(0.3)  # another process's state: nothing to wait on but polling
        assert "worker pids" in status and "pid" in status.splitlines()[2]
        for node_id, (agent, _) in table.items():
            # The agent is the node's process the engine started.
            pid_file = home / "jobs" / "chat" / "nodes" / node_id / "pid"
            assert agent == int(pid_file.read_text().split()[0])

        # 2. Logs: one rank's lines are that script's own prints, from its latest attempt.
        r = dlrover(home, "logs", "chat", "--rank", "2", "-n", "5")
        assert r.returncode == 0, r.stderr
        got = lines_of(r.stdout)
        assert got and all(line.startswith("chatty rank=2 ") for line in got), r.stdout
        r = dlrover(home, "logs", "chat", "--rank", "1", "-n", "3")
        stdout_lines = [line for line in lines_of(r.stdout) if " step=" in line]
        assert stdout_lines and all("attempt=1" in line for line in stdout_lines), r.stdout
        everything = dlrover(home, "logs", "chat", "-n", "2").stdout
        for rank in range(4):
            assert f"==> rank {rank} (chat-worker-" in everything
            assert f"chatty rank={rank} " in everything
        node = next(iter(table))
        own = dlrover(home, "logs", "chat", "--node", node).stdout
        assert "dlrover.agent" in own and "chatty rank=" not in own  # the agent's own log
        bad = dlrover(home, "logs", "chat", "--rank", "9")
        assert bad.returncode == 1 and "ranks with logs: 0, 1, 2, 3" in bad.stderr
        bad = dlrover(home, "logs", "chat", "--node", "nope")
        assert bad.returncode == 1 and "has no node 'nope'; its nodes: chat-worker-" in bad.stderr
        assert "no job named 'nope'" in dlrover(home, "logs", "nope").stderr

        # 3. -f: Ctrl-C ends it; a second follower sees new lines and ends with the job.
        # Started as from a terminal: SIGINT with its default action and not blocked, whatever
        # this test process (an xdist worker that ran other tests before) has done with it: an
        # ignored SIGINT and a blocked one are both inherited by a child, and the follower then
        # never hears Ctrl-C (it rightly leaves an inherited SIG_IGN as it is).
        interrupted = subprocess.Popen(
            [*run_cmd("dlrover.cli.job"), "logs", "chat", "--rank", "0", "-f", "-n", "1"],
            env=clean_env(DLROVER_HOME=str(home)), cwd=REPO, stdout=subprocess.PIPE, text=True,
            preexec_fn=_terminal_sigint,
        )  # fmt: skip
        assert interrupted.stdout is not None
        assert interrupted.stdout.readline().startswith("chatty rank=0")  # it is following
        interrupted.send_signal(signal.SIGINT)
        # Read what it still writes until it ends: a follower blocked on a full pipe that nobody
        # reads cannot get to its Ctrl-C flag (seen beside another stage: 30 s without an exit).
        try:
            interrupted.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            # How its SIGINT is handled (ignored / caught masks), and its stacks (to stderr).
            masks = [
                line
                for line in Path(f"/proc/{interrupted.pid}/status").read_text().splitlines()
                if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))
            ]
            interrupted.send_signal(signal.SIGUSR1)
            time.sleep(1)
            interrupted.kill()
            interrupted.communicate(timeout=10)
            raise AssertionError(
                f"logs -f did not end within 30 s of Ctrl-C ({masks}; SIGINT is 0x2; this "
                f"process's SIGINT handler: {signal.getsignal(signal.SIGINT)}); stacks: stderr"
            ) from None
        assert interrupted.returncode == 0
        # Piped into a reader that stops reading (`| head -1`): it ends quietly at its next line.
        piped = subprocess.Popen(
            [*run_cmd("dlrover.cli.job"), "logs", "chat", "--rank", "1", "-f", "-n", "1"],
            env=clean_env(DLROVER_HOME=str(home)), cwd=REPO, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert piped.stdout is not None and piped.stderr is not None
        assert piped.stdout.readline().startswith("chatty rank=1")
        piped.stdout.close()
        assert piped.wait(30) == 0
        assert piped.stderr.read() == ""  # no BrokenPipeError traceback
        follower = subprocess.Popen(
            [*run_cmd("dlrover.cli.job"), "logs", "chat", "--rank", "3", "-f", "-n", "1"],
            env=clean_env(DLROVER_HOME=str(home)), cwd=REPO, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert follower.stdout is not None
        steps = []
        while len(steps) < 4:  # the tail's line, then lines written since
            line = follower.stdout.readline()
            assert line, "the follower ended before the job"
            if " step=" in line:
                assert line.startswith("chatty rank=3 ")
                steps.append(int(line.rsplit("=", 1)[1]))
        assert steps == list(range(steps[0], steps[0] + 4))  # each line once, in order
        stopped = dlrover(home, "stop", "chat")
        assert stopped.returncode == 0, stopped.stderr
        assert follower.wait(60) == 0  # it ended by itself with the job
        assert job.wait(30) != 0

        # 4. The ended job's status: its last table (the same processes), plans, failures.
        ended = dlrover(home, "status", "chat")
        assert ended.returncode == 0, ended.stderr
        assert ended.stdout.startswith("job chat: failed - stopped by dlrover stop")
        final = rows(ended.stdout)
        assert set(final) == set(table) and all(final[n][0] == table[n][0] for n in table)
        assert "plans: none" in ended.stdout
        assert "failures (1):" in ended.stdout
        failure = next(line for line in ended.stdout.splitlines() if "SIGKILL" in line)
        assert "signal" in failure and "restart_processes" in failure and "rank 1" in failure
        # Its logs stay readable from the job directory.
        after = dlrover(home, "logs", "chat", "--rank", "3", "-n", "1")
        assert after.returncode == 0 and lines_of(after.stdout)[-1].startswith("chatty rank=3")
    finally:
        if job.poll() is None:  # a failed check: stop the job's nodes too, not only `submit`
            with contextlib.suppress(subprocess.TimeoutExpired):  # the failure says more
                dlrover(home, "stop", "chat", "--timeout", "20")
        for proc in (job, follower):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(10)
        log.close()
