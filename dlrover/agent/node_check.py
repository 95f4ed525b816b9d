"""The pre-flight node check, agent side (``dlrover-run --node-check``).

After a rendezvous round closes and before workers start, the agent checks its node with the
round's other members: it joins each check round at the master (a long poll that ends when every
member joined and the master paired them), runs the tests of its group in a `check_worker`
process (started early, so that importing torch overlaps the rendezvous), and reports the result.
The master's verdict (dlrover/master/node_check.py) says: train, join the rendezvous again (a
member was excluded or lost), or leave the job (this node is faulty, or a straggler that
``--exclude-straggler`` excludes).
"""

from __future__ import annotations

import enum
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from dlrover.agent.check_worker import CheckDone, CheckRun, WorkerReady
from dlrover.agent.rendezvous_client import AgentError
from dlrover.api.master import (
    CommWorld,
    MasterApi,
    NodeCheckJoin,
    NodeCheckReport,
    NodeCheckState,
    NodeCheckTask,
)
from dlrover.constants import EXIT_NODE_EXCLUDED, MAX_LONG_POLL_S
from dlrover.faults import ENV_FAULTS, FaultSpecError, node_check_faults, node_slot
from dlrover.json_messages import MessageError, decode_tagged, encode, parse

logger = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 300.0
"""The whole check of one rendezvous round must end within this (the master times out a check
round after 60 s, so this is a backstop)."""
COLLECTIVE_TIMEOUT_S = 5.0
"""A group's collective test fails if its process group does not form and reduce within this."""
WORKER_START_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 60.0
"""One run of the tests must answer within this (a hung device or collective fails it)."""
EXIT_EXCLUDED = EXIT_NODE_EXCLUDED
"""dlrover-run's exit code when the node check excluded the node (its engine relaunches it)."""


class CheckOutcome(enum.Enum):
    """What the agent does after the check."""

    TRAIN = "train"
    REFORM = "reform"
    EXCLUDED = "excluded"


@dataclass(frozen=True)
class CheckSettings:
    """The agent's node-check flags."""

    straggler_ratio: float = 2.0
    exclude_stragglers: bool = False


class NodeCheckError(AgentError):
    """The check could not run here (its worker did not start or died)."""


class CheckWorker:
    """The `check_worker` process; `start` it early, `run` tests in it, `close` it."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = threading.Event()
        self._backend = ""
        self._error = ""

    def start(self) -> None:
        """Start the process (it imports torch in the background)."""
        self._ready.clear()
        self._error = ""
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "dlrover.agent.check_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        threading.Thread(target=self._await_ready, name="check-worker-ready", daemon=True).start()

    def _await_ready(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        line = self._proc.stdout.readline()
        try:
            ready = decode_tagged(parse(line, "check worker"), "event", {"ready": WorkerReady}, "")
            self._backend = ready.backend
        except MessageError as e:
            self._error = f"the check worker did not start ({e}; exit {self._proc.poll()})"
        self._ready.set()

    def wait_ready(self, timeout_s: float = WORKER_START_TIMEOUT_S) -> bool:
        """Whether the worker imported torch (or failed to) within ``timeout_s``."""
        return self._ready.wait(timeout_s)

    def run(self, run: CheckRun) -> CheckDone:
        """Run one check in the worker, at most RUN_TIMEOUT_S; a worker that is gone, hangs or
        answers garbage is a failed check (its error says so), and a dead one is started again
        for the next run."""
        proc = self._proc
        if proc is not None and proc.poll() is not None:
            self.close()  # died in an earlier run (e.g. a collective's watchdog): a fresh one
            proc = None
        if proc is None:
            self.start()
            proc = self._proc
        assert proc is not None
        if not self._ready.wait(WORKER_START_TIMEOUT_S):
            return CheckDone(
                False, error=f"the check worker did not start in {WORKER_START_TIMEOUT_S:.0f}s"
            )
        if self._error:
            return CheckDone(False, error=self._error)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(encode(run, op="run"))
            proc.stdin.flush()
            readable, _, _ = select.select([proc.stdout], [], [], RUN_TIMEOUT_S)
            if not readable:
                self.close()
                return CheckDone(False, error=f"the check did not finish in {RUN_TIMEOUT_S:.0f}s")
            line = proc.stdout.readline()
            return decode_tagged(parse(line, "check worker"), "event", {"done": CheckDone}, "")
        except (OSError, MessageError) as e:
            return CheckDone(False, error=f"the check worker failed: {e} (exit {proc.poll()})")

    def close(self) -> None:
        """End the worker (closing its stdin ends it; killed if it lingers)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()


class NodeChecker:
    """Runs the node check of each rendezvous round for one agent."""

    def __init__(
        self,
        master: MasterApi,
        host: str,
        settings: CheckSettings,
        identity: Callable[[], tuple[str, int]],
        free_port: Callable[[], int],
        requested_rank: int = -1,
    ) -> None:
        self._master = master
        self._host = host
        self._settings = settings
        self._identity = identity
        self._requested_rank = requested_rank
        self._free_port = free_port
        self._worker: CheckWorker | None = None

    def prepare(self) -> None:
        """Start the check worker now, so its imports overlap the rendezvous."""
        if self._worker is None:
            self._worker = CheckWorker()
            self._worker.start()

    def close(self) -> None:
        """Stop the check worker."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def check(self, world: CommWorld) -> tuple[CheckOutcome, str]:
        """Check this node with the members of ``world``; returns what to do and why (the
        master's verdict in one line, or why this node is excluded)."""
        node_id, incarnation = self._identity()
        try:
            slow, fail = node_check_faults(
                os.environ.get(ENV_FAULTS, ""), node_slot(node_id, self._requested_rank)
            )
        except FaultSpecError as e:
            logger.warning("ignoring DLROVER_FAULTS in the node check: %s", e)
            slow, fail = 1.0, False
        started = time.monotonic()
        deadline = started + CHECK_TIMEOUT_S
        # Join only once torch is imported: a partner must not wait out its collective time-out
        # for this node's imports.
        self.prepare()
        assert self._worker is not None
        self._worker.wait_ready()
        check_round = 1
        while True:
            task = self._join(node_id, incarnation, world.round, check_round, deadline)
            if task.state is NodeCheckState.DONE:
                self.close()
                if task.excluded:
                    return CheckOutcome.EXCLUDED, task.reason
                logger.info(
                    "node check passed in %.1fs: %s", time.monotonic() - started, task.summary
                )
                return CheckOutcome.TRAIN, task.summary
            if task.state is NodeCheckState.REFORM:
                logger.info("node check: %s; joining the rendezvous again", task.summary)
                return CheckOutcome.REFORM, task.summary
            if task.peers:
                self.prepare()
                assert self._worker is not None
                done = self._worker.run(
                    CheckRun(
                        list(task.peers),
                        task.index,
                        COLLECTIVE_TIMEOUT_S,
                        slow if check_round == 1 else 1.0,
                        fail,
                    )
                )
                logger.info(
                    "node check round %d with %d node(s): %s",
                    check_round,
                    len(task.peers),
                    f"ok, compute {done.compute_s:.3f}s, collective {done.comm_s:.3f}s"
                    if done.ok
                    else done.error,
                )
                self._master.report_node_check(
                    NodeCheckReport(
                        node_id,
                        incarnation,
                        world.round,
                        check_round,
                        done.ok,
                        done.compute_s,
                        done.comm_s,
                        done.error,
                    )
                )
            check_round += 1

    def _join(
        self, node_id: str, incarnation: int, rdzv_round: int, check_round: int, deadline: float
    ) -> NodeCheckTask:
        addr = f"{self._host}:{self._free_port()}"
        join = NodeCheckJoin(
            node_id,
            incarnation,
            rdzv_round,
            check_round,
            addr,
            self._settings.straggler_ratio,
            self._settings.exclude_stragglers,
        )
        while True:
            task = self._master.join_node_check(join, wait_s=MAX_LONG_POLL_S)
            if task.state is not NodeCheckState.WAIT:
                return task
            if time.monotonic() > deadline:
                raise NodeCheckError(
                    f"the node check of round {rdzv_round} did not end within {CHECK_TIMEOUT_S:.0f}s"
                )
