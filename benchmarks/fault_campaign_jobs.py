"""The fault campaign's stream and PS job types: a broker outage and a SIGKILLed embedding server.

Jobs whose index is 4 or 5 modulo 6 are of these types (``job_type``): a share fixed by the
index, so that ``--only N`` runs job N of the same draw. Their schedules come from the
campaign's seeded draw like the all-reduce jobs'.

- **stream** (index % 6 == 4): `dlrover submit` of 2 or 3 nodes x 1 worker training
  benchmarks/fault_campaign_stream_train.py on a topic of a real Kafka-protocol broker
  (noida-db, started by the campaign on loopback) holding every record before the job starts.
  Schedule: 1-2 ``broker_outage`` (the campaign stops the broker with SIGTERM when rank 0
  reports the step, waits 1-4 s, and starts it again on the same port and data) and, in half
  the jobs, a ``worker_kill`` (DLROVER_FAULTS). Completed: exit 0 and every record trained
  exactly once (the all-ones counter hash).
- **ps** (index % 6 == 5): `dlrover submit --ps 2|3 --ps-replica sync` training
  examples/train_embedding.py (1 worker). Schedule: 1-2 ``ps_kill`` (SIGKILL of an embedding
  server's process when the worker reports the step; a second one waits until the first
  server's replacement is serving: with one replica, two overlapping failures of neighbours
  lose rows by design). Completed: exit 0 and the model (MLP and every embedding row) equal to
  the failure-free run's. No worker SIGKILL: the example keeps no checkpoint, so a restarted
  worker trains again from step 1 against rows the servers already updated.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
STREAM_TRAIN = str(Path(__file__).resolve().with_name("fault_campaign_stream_train.py"))
EMBEDDING = str(REPO / "examples" / "train_embedding.py")
EVERY = 6
"""One job in EVERY is a stream job, one a PS job."""
RECORDS = 240
"""Records of the stream job's topic (3 partitions of 80)."""
PARTITIONS = 3
STREAM_BATCH = 2
PS_STEPS = 240
KINDS = ("broker_outage", "ps_kill")
"""The fault classes these job types add (goodput is reported per class)."""


def job_type(index: int) -> str:
    """``stream``, ``ps`` or ``allreduce``: what kind of job the campaign's job ``index`` is."""
    return {4: "stream", 5: "ps"}.get(index % EVERY, "allreduce")


@dataclass
class OtherSchedule:
    """One stream or PS job's draw. ``faults`` hold (kind, target, step): the target is a rank
    for worker_kill, an outage's seconds for broker_outage, a server index for ps_kill."""

    index: int
    job: str
    size: int
    """Worker nodes of a stream job, embedding servers of a PS job."""
    faults: list[tuple[str, int, int]]
    should_fail: bool = False
    needs_cgroup: bool = False
    needs_small_disk: bool = False

    @property
    def nodes(self) -> str:
        """The table's nodes column, and the key of this type and size's failure-free run."""
        return f"{self.job} {self.size}"

    @property
    def steps(self) -> int:
        """The job's steps (a stream job's about: its ranks read what they lease)."""
        if self.job == "ps":
            return PS_STEPS
        return RECORDS // (STREAM_BATCH * self.size)

    def describe(self) -> str:
        """The table's faults column."""
        parts = []
        for kind, target, step in self.faults:
            if kind == "broker_outage":
                parts.append(f"broker_outage@s{step}({target}s)")
            elif kind == "ps_kill":
                parts.append(f"ps_kill@ps{target}s{step}")
            else:
                parts.append(f"{kind}@r{target}s{step}")
        return ", ".join(parts)

    def listing(self) -> str:
        """The --list line."""
        what = (
            f"stream job, {self.size} nodes, ~{self.steps} steps"
            if self.job == "stream"
            else f"PS job, 1 worker + {self.size} embedding servers, {self.steps} steps"
        )
        return f"{self.index}: {what}: {self.describe()}"


def draw(rng: random.Random, index: int) -> OtherSchedule:
    """The schedule of job ``index`` (a stream or PS one), from the campaign's generator."""
    kind = job_type(index)
    size = rng.choice([2, 3])
    if kind == "stream":
        steps = RECORDS // (STREAM_BATCH * size)
        faults = [
            ("broker_outage", rng.randint(1, 4), rng.randint(3, steps // 2))
            for _ in range(rng.randint(1, 2))
        ]
        if rng.random() < 0.5:
            faults.append(("worker_kill", rng.randrange(size), rng.randint(2, 2 * steps // 3)))
    else:
        faults = [
            ("ps_kill", rng.randrange(size), rng.randint(20, PS_STEPS - 60))
            for _ in range(rng.randint(1, 2))
        ]
    return OtherSchedule(index, kind, size, faults)


def failure_free(schedules: list[Any]) -> list[OtherSchedule]:
    """One fault-free job per type and size among ``schedules``: the goodput floor, and the
    PS job's reference model."""
    sizes = sorted({(s.job, s.size) for s in schedules if isinstance(s, OtherSchedule)})
    return [OtherSchedule(size, job, size, []) for job, size in sizes]


def stream_missing() -> str:
    """Why no stream job can run here ("" where one can)."""
    sys.path.insert(0, str(REPO))
    from tests.kafka_broker import kafka_missing

    return kafka_missing()


@dataclass(frozen=True)
class Harness:
    """What the campaign lends these job types: its environment, process and leak checks,
    checkpoint check and result type (one copy of each, in benchmarks/fault_campaign.py)."""

    env: Callable[..., dict[str, str]]
    ours: Callable[[Path], list[psutil.Process]]
    leaks: Callable[[str], list[str]]
    torn: Callable[[Path, str], bool]
    """Whether the storage checkpoint under a job folder's ckpt/ is not this final hash."""
    result: Callable[..., Any]


@dataclass
class _Driver:
    """The campaign's side of a job's faults: a thread that acts at reported steps."""

    stop: threading.Event = field(default_factory=threading.Event)
    fired: list[str] = field(default_factory=list)
    error: str = ""


def _reached(
    path: Path, step: int, driver: _Driver, extra: Callable[[], bool] = lambda: True
) -> bool:
    """Wait until the step last written to ``path`` (another process writes it: polled) is at
    least ``step`` and ``extra`` holds; False when the job ended first."""
    while not driver.stop.is_set():
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The last line's first field: a progress file's only line, a steps file's step.
            if int(path.read_text().splitlines()[-1].split()[0]) >= step and extra():
                return True
        driver.stop.wait(0.05)
    return False


class OtherJobs:
    """Runs stream and PS jobs for the campaign; keeps each PS size's failure-free model."""

    def __init__(self, harness: Harness) -> None:
        self.harness = harness
        self.reference: dict[int, str] = {}

    def not_run(self, sched: OtherSchedule, launcher: str, no_stream: str) -> str:
        """Why ``sched`` does not run under ``launcher`` here ("" where it does)."""
        if launcher != "dlrover":
            return "n/a"  # no master to lease stream ranges, no embedding servers
        if sched.job == "stream" and no_stream:
            return f"skipped (the stream job needs a broker: {no_stream})"
        return ""

    def run(
        self, sched: OtherSchedule, base: Path, faults: bool, deadline_s: float, keep: bool
    ) -> Any:
        """Run one job of ``sched`` (its faults only with ``faults``) and judge it."""
        tag = "x" if faults else "ff"
        name = f"fc{os.getpid() % 10000}-{sched.job[0]}{sched.index}{tag}"
        root = base / name
        (root / "ckpt").mkdir(parents=True)
        schedule = sched.faults if faults else []
        driver = _Driver()
        broker = None
        if sched.job == "stream":
            broker = self._broker(root)
            cmd, steps_file = self._stream_cmd(sched, root, name, broker.bootstrap)
        else:
            cmd, steps_file = self._ps_cmd(sched, root, name)
        spec = ";".join(
            f"kill:rank={rank}:step={step}:restart=*:once={root / f'fired-{n}'}"
            for n, (kind, rank, step) in enumerate(schedule)
            if kind == "worker_kill"
        )
        env = self.harness.env(DLROVER_HOME=str(root / "home"), DLROVER_FAULTS=spec)
        started = time.monotonic()
        with open(root / "launcher.log", "wb") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
        thread = threading.Thread(
            target=self._drive, args=(schedule, root, name, steps_file, broker, driver), daemon=True
        )
        thread.start()
        hung = False
        try:
            proc.wait(deadline_s)
        except subprocess.TimeoutExpired:
            hung = True
        wall = time.monotonic() - started
        driver.stop.set()
        thread.join(60)
        if broker is not None:
            broker.stop(graceful=True)  # the campaign's, not the job's: gone before the scan
        if hung:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(1.0)  # the launcher's children get their parent-death signal
        orphans = self.harness.ours(root)
        for p in orphans:
            with contextlib.suppress(psutil.Error):
                p.kill()
        code = proc.wait(10)
        result = self.harness.result(
            "", wall, orphans=0 if hung else len(orphans),
            leaks=[] if hung else self.harness.leaks(name),
        )  # fmt: skip
        not_fired = [f for f in driver.fired if f.startswith("not reached")] + [
            f"not reached: {kind}@r{rank}s{step}"
            for n, (kind, rank, step) in enumerate(schedule)
            if kind == "worker_kill" and not (root / f"fired-{n}").exists()
        ]
        if hung:
            result.verdict = "hung"
        elif code != 0:
            result.verdict, result.note = "wrong", f"exit code {code}"
        elif sched.job == "stream":
            self._judge_stream(root, result)
        else:
            self._judge_ps(sched, root, faults, result)
        if driver.error or not_fired:
            result.note += f" ({'; '.join(filter(None, [driver.error, *not_fired]))})"
        if keep or result.verdict in ("wrong", "hung"):
            result.note += f" (kept: {root})"
        else:
            shutil.rmtree(root, ignore_errors=True)
        return result

    # -- stream ------------------------------------------------------------------------------

    @staticmethod
    def _broker(root: Path) -> Any:
        sys.path.insert(0, str(REPO))
        from tests.kafka_broker import KafkaBroker

        (root / "broker").mkdir()
        broker = KafkaBroker(root / "broker")
        broker.create_topic("clicks", PARTITIONS)
        broker.produce(
            "clicks", [(i % PARTITIONS, json.dumps({"id": i}).encode()) for i in range(RECORDS)]
        )
        return broker

    @staticmethod
    def _stream_cmd(
        sched: OtherSchedule, root: Path, name: str, bootstrap: str
    ) -> tuple[list[str], Path]:
        cmd = [
            sys.executable, "-m", "dlrover.cli.job", "submit", "--name", name,
            "--nnodes", str(sched.size), "--nproc-per-node", "1", "--max-restarts", "3",
            "--hang-timeout", "30", STREAM_TRAIN, "--bootstrap", bootstrap, "--topic", "clicks",
            "--records", str(RECORDS), "--partitions", str(PARTITIONS),
            "--batch", str(STREAM_BATCH), "--ckpt", str(root / "ckpt"), "--out", str(root / "out"),
        ]  # fmt: skip
        return cmd, root / "out.progress"

    def _judge_stream(self, root: Path, result: Any) -> None:
        import torch

        from dlrover.testing.digest import tensors_digest

        final_path = root / "out.final"
        if not final_path.exists():
            result.verdict, result.note = "wrong", "no final counts"
            return
        final = json.loads(final_path.read_text())
        result.lost, result.duplicated = final["lost"], final["duplicated"]
        expected = tensors_digest([torch.ones(RECORDS, dtype=torch.int64)])
        result.verdict = "completed" if final["hash"] == expected else "wrong"
        result.torn = self.harness.torn(root, final["hash"])

    # -- ps ----------------------------------------------------------------------------------

    @staticmethod
    def _ps_cmd(sched: OtherSchedule, root: Path, name: str) -> tuple[list[str], Path]:
        cmd = [
            sys.executable, "-m", "dlrover.cli.job", "submit", "--name", name,
            "--nproc-per-node", "1", "--ps", str(sched.size), "--ps-replica", "sync",
            EMBEDDING, "--steps", str(PS_STEPS), "--step-time", "0.04",
            "--out", str(root / "out"),
        ]  # fmt: skip
        return cmd, root / "out.steps"

    @staticmethod
    def _model_hash(path: Path) -> str:
        import torch

        from dlrover.testing.digest import tensors_digest

        model = torch.load(path)
        mlp = [model["mlp"][k] for k in sorted(model["mlp"])]
        return tensors_digest([model["ids"], model["deep"], model["wide"], *mlp])

    def _judge_ps(self, sched: OtherSchedule, root: Path, faults: bool, result: Any) -> None:
        if not (root / "out.pt").exists():
            result.verdict, result.note = "wrong", "no model written"
            return
        digest = self._model_hash(root / "out.pt")
        if not faults:
            self.reference[sched.size] = digest
        same = digest == self.reference.get(sched.size)
        result.verdict = "completed" if same else "wrong"
        if not same:
            result.note = "another model than the failure-free run's"
        log = (root / "launcher.log").read_text(errors="replace")
        kills = sum(kind == "ps_kill" for kind, _, _ in sched.faults) if faults else 0
        replaced = len(re.findall(r"embedding server \d+ replaced by", log))
        restarted = {line.split()[2] for line in (root / "out.steps").read_text().splitlines()}
        if same and (replaced < kills or restarted != {"0"}):
            # A kill that did not fire is said in the note; a worker restart is not expected.
            result.note += f" ({replaced} of {kills} servers replaced, restarts {restarted})"

    @staticmethod
    def _ps_pid(root: Path, name: str, index: int) -> int | None:
        """The pid of the newest attempt of embedding server ``index``."""
        nodes = root / "home" / "jobs" / name / "nodes"
        attempts = sorted(
            nodes.glob(f"{name}-ps-{index}-*"), key=lambda p: int(p.name.rsplit("-", 1)[1])
        )
        for node in reversed(attempts):
            with contextlib.suppress(OSError, ValueError, IndexError):
                return int((node / "pid").read_text().split()[0])
        return None

    # -- the faults the campaign drives ------------------------------------------------------

    def _drive(
        self,
        schedule: list[tuple[str, int, int]],
        root: Path,
        name: str,
        steps_file: Path,
        broker: Any,
        driver: _Driver,
    ) -> None:
        kills_done = 0
        try:
            for kind, target, step in sorted(
                (f for f in schedule if f[0] != "worker_kill"), key=lambda f: f[2]
            ):
                if kind == "broker_outage":
                    if not _reached(steps_file, step, driver):
                        driver.fired.append(f"not reached: broker_outage@s{step}")
                        return
                    broker.stop(graceful=True)
                    driver.stop.wait(target)  # the outage itself; ends early when the job does
                    broker.start()
                    driver.fired.append(f"broker_outage@s{step}")
                    continue

                def served(n: int = kills_done) -> bool:
                    log = (root / "launcher.log").read_text(errors="replace")
                    return len(re.findall(r"embedding server \d+ replaced by", log)) >= n

                if not _reached(steps_file, step, driver, served):
                    driver.fired.append(f"not reached: ps_kill@ps{target}s{step}")
                    return
                pid = self._ps_pid(root, name, target)
                if pid is None:
                    driver.error = f"no pid of embedding server {target}"
                    return
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                kills_done += 1
                driver.fired.append(f"ps_kill@ps{target}s{step}")
        except Exception as exc:  # noqa: BLE001 - said in the job's note, the job goes on
            driver.error = f"the fault driver failed: {exc!r}"
