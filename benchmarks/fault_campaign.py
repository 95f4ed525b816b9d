"""Fault campaign: N seeded multi-node jobs, each with 1-4 random faults, under dlrover and torchrun.

Run: PYTHONPATH=. python benchmarks/fault_campaign.py [--jobs 50] [--seed 1] [--no-torchrun]
(``--list`` prints the drawn schedules; ``--only 1 4`` runs those jobs of the same draw;
``--keep`` keeps every job's folder, not only the wrong or hung ones)

Each job is a real `dlrover submit` of 2 or 3 nodes x 1 worker on the local engine training
benchmarks/fault_campaign_train.py (dynamic shards from the master, a flash checkpoint every
step, storage every 5 steps, an exact order-free oracle: one counter per sample). Its schedule
(drawn from the seed) puts 1-4 faults from KINDS at random ranks and steps, through
DLROVER_FAULTS, each firing once (a ``once`` marker) except ``exception_twice``, which fires on
every attempt and must make the job fail fast. The same schedule runs under torchrun (one
torchrun per node, c10d rendezvous, ``--max-restarts 3``, the static elastic sampler) where
every fault of it applies there (kill_agent and lose_node need an agent).

Verdicts: ``completed`` (exit 0, the final counters hash equal to the failure-free model's, no
sample lost or duplicated), ``failed fast`` (a should-fail job ended non-zero naming the
injected exception within two attempts), ``failed late`` (the same, with more attempts),
``wrong`` (ended 0 with another model, or a should-complete job failed), ``hung`` (past the
deadline). Also per job: torn checkpoints (the storage checkpoint left does not load, or is not
the final step's model), orphan processes, leaked /dev/shm entries, cgroups and temp folders,
and goodput (the failure-free run's wall time of the same launcher and size / this job's).
One job in 6 is a stream job (a broker outage) and one a PS job (a killed embedding server):
benchmarks/fault_campaign_jobs.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import fault_campaign_jobs as jobs  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TRAIN = str(Path(__file__).resolve().with_name("fault_campaign_train.py"))
SAMPLES = 384  # divisible by 2 x 4 and 3 x 4: no static padding at either size


@dataclass(frozen=True)
class Kind:
    """A fault kind of the campaign: its DLROVER_FAULTS item and where it applies."""

    item: str
    """``{rank}``, ``{step}`` and ``{once}`` are filled in."""
    torchrun: bool
    """Whether torchrun can run it (kill_agent and lose_node need a dlrover agent)."""


KINDS = {
    "worker_kill": Kind("kill:rank={rank}:step={step}:restart=*:once={once}", True),
    "exception_once": Kind("raise:rank={rank}:step={step}:restart=*:once={once}", True),
    "exception_twice": Kind("raise:rank={rank}:step={step}:restart=*", True),
    "hang": Kind("hang:rank={rank}:step={step}:restart=*:once={once}", True),
    "agent_kill": Kind("kill_agent:rank={rank}:step={step}:restart=*:once={once}", False),
    "node_lost": Kind("lose_node:rank={rank}:step={step}:restart=*:once={once}", False),
    "slow_node": Kind("slow:rank={rank}:step={step}:factor=3", True),
    "master_kill": Kind("kill_master:rank={rank}:step={step}:restart=*:once={once}", False),
    "worker_oom": Kind("oom:rank={rank}:step={step}:restart=*:once={once}", False),
    "disk_full": Kind(
        "fill_disk:rank={rank}:step={step}:restart=*:once={once}:seconds=3:path={ckpt}", True
    ),
    # Full from the first step to the end: every saver the job starts (the first, and any
    # that replaces a lost node) finds no room in its shared memory.
    "shm_full": Kind(
        "fill_disk:rank={rank}:step=1:restart=*:once={once}:seconds=inf:path={shm}", True
    ),  # fmt: skip
}
NODE_MEMORY = "1536Mi"
"""Each node's memory limit in a job with worker_oom (agent, zygote and worker fit in it)."""
SMALL_DISK = "32m"
"""The size of the tmpfs mounted as the checkpoint folder of a job with disk_full."""
SMALL_SHM = "4m"
"""The size of the tmpfs mounted as the shared-memory folder (DLROVER_CKPT_SHM_DIR) of a job
with shm_full."""


@dataclass
class Schedule:
    """One job's draw: its node count and faults (kind, rank, step)."""

    index: int
    nodes: int
    faults: list[tuple[str, int, int]]

    @property
    def steps(self) -> int:
        return SAMPLES // (4 * self.nodes)

    @property
    def needs_cgroup(self) -> bool:
        """Whether a node memory limit is part of the job (an OOM kill needs one)."""
        return any(kind == "worker_oom" for kind, _, _ in self.faults)

    @property
    def needs_small_disk(self) -> bool:
        """Whether the job's checkpoints go to a filesystem of its own (disk_full fills it)."""
        return any(kind == "disk_full" for kind, _, _ in self.faults)

    @property
    def needs_small_shm(self) -> bool:
        """Whether the job's shared memory is a filesystem of its own (shm_full fills it)."""
        return any(kind == "shm_full" for kind, _, _ in self.faults)

    @property
    def should_fail(self) -> bool:
        return any(kind == "exception_twice" for kind, _, _ in self.faults)

    def spec(self, root: Path) -> str:
        items = []
        for n, (kind, rank, step) in enumerate(self.faults):
            once = root / f"fired-{n}"
            item = KINDS[kind].item
            items.append(
                item.format(rank=rank, step=step, once=once, ckpt=root / "ckpt", shm=root / "shm")
            )
        return ";".join(items)

    def describe(self) -> str:
        return ", ".join(f"{kind}@r{rank}s{step}" for kind, rank, step in self.faults)


def draw(rng: random.Random, index: int) -> Schedule:
    nodes = rng.choice([2, 3])
    steps = SAMPLES // (4 * nodes)
    faults = [
        (rng.choice(sorted(KINDS)), rng.randrange(nodes), rng.randint(2, steps - 2))
        for _ in range(rng.randint(1, 4))
    ]
    # shm_full strikes before the first save (step 1), whatever step was drawn.
    faults = [(k, r, 1 if k == "shm_full" else s) for k, r, s in faults]
    return Schedule(index, nodes, faults)


@dataclass
class Result:
    """What one job of one launcher came to."""

    verdict: str
    wall_s: float
    lost: int = 0
    duplicated: int = 0
    torn: bool = False
    orphans: int = 0
    leaks: list[str] = field(default_factory=list)
    note: str = ""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DLROVER_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _train_args(root: Path) -> list[str]:
    return [
        TRAIN,
        "--samples",
        str(SAMPLES),
        "--ckpt",
        str(root / "ckpt"),
        "--out",
        str(root / "out"),
    ]


def _launch(
    sched: Schedule, launcher: str, root: Path, name: str, faults: str
) -> list[subprocess.Popen[bytes]]:
    (root / "ckpt").mkdir(parents=True)
    if faults and sched.needs_small_disk:
        _mount_small(root / "ckpt")
    shm: dict[str, str] = {}
    if faults and sched.needs_small_shm:
        (root / "shm").mkdir()
        _mount_small(root / "shm", SMALL_SHM)
        shm["DLROVER_CKPT_SHM_DIR"] = str(root / "shm")
    log = open(root / "launcher.log", "wb")  # noqa: SIM115 - closed by the children's exit
    if launcher == "dlrover":
        cmd = [
            sys.executable, "-m", "dlrover.cli.job", "submit", "--name", name,
            "--nnodes", str(sched.nodes), "--nproc-per-node", "1", "--max-restarts", "3",
            "--hang-timeout", "10",
            *(["--memory", NODE_MEMORY] if sched.needs_cgroup else []), *_train_args(root),
        ]  # fmt: skip
        env = _env(DLROVER_HOME=str(root / "home"), DLROVER_FAULTS=faults, **shm)
        return [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 start_new_session=True)]  # fmt: skip
    port = _free_port()
    env = _env(DLROVER_FAULTS=faults, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **shm)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nnodes={sched.nodes}",
        "--nproc-per-node=1", "--max-restarts=3", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={name}", *_train_args(root),
    ]  # fmt: skip
    return [
        subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True)
        for _ in range(sched.nodes)
    ]  # fmt: skip


def _ours(root: Path) -> list[psutil.Process]:
    """Live processes started for this job: their command line names its folder, or they run
    in its DLROVER_HOME (the nodes the master launched, embedding servers among them, in
    sessions of their own)."""
    found = []
    home = str(root / "home")
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmdline = proc.info["cmdline"] or ()
            # fill_disk's remover is the fault's, not the job's: it ends by itself.
            named = any(str(root) in part and ".dlrover-fill-" not in part for part in cmdline)
            if named or (proc.pid != os.getpid() and proc.environ().get("DLROVER_HOME") == home):
                found.append(proc)
    return found


def _kill_all(root: Path, launchers: list[subprocess.Popen[bytes]]) -> None:
    for p in launchers:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    for proc in _ours(root):
        with contextlib.suppress(psutil.Error):
            proc.kill()


def _leaks(name: str, root: Path | None = None) -> list[str]:
    """What the job left in /dev/shm (or its own, under ``root``), the temp folder and the
    cgroup tree."""
    left = []
    own = [] if root is None else [root / "shm"]
    for folder in (Path("/dev/shm"), *own, Path(tempfile.gettempdir())):
        left += [str(p) for p in folder.glob(f"*.{name}.*")]
    for d in Path("/sys/fs/cgroup").glob(f"*/**/dlrover-{name}-*"):
        left.append(str(d))
    for d in Path("/sys/fs/cgroup").glob("*/**/dlrover-slow-*"):
        pid = int(d.name.split("-")[2])
        if not psutil.pid_exists(pid):
            left.append(str(d))
    return left


def _verify_checkpoint(root: Path, final_hash: str) -> bool:
    """Whether the checkpoint left on storage is torn: it does not load in a fresh process or
    is not the final model."""
    code = (
        "import os, torch.distributed as dist, json\n"
        "from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer\n"
        "from dlrover.testing.digest import tensors_digest\n"
        "dist.init_process_group('gloo', rank=0, world_size=1)\n"
        f"s = DdpCheckpointer({str(root / 'ckpt')!r}).load_checkpoint()\n"
        "print(json.dumps({'hash': tensors_digest([s['model']]) if s else ''}))\n"
    )
    env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    # A fresh interpreter imports torch: on a busy machine that alone can take a minute.
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=900, cwd=root)  # fmt: skip
    if r.returncode != 0:
        return True
    return json.loads(r.stdout.strip().splitlines()[-1])["hash"] != final_hash


PORT_TAKEN = "Ping failed, invalid value returned from server"
"""What torch's TCPStore client logs when its port answers but is not the job's store."""


def run_job(
    sched: Schedule,
    launcher: str,
    base: Path,
    faults: bool,
    deadline_s: float,
    expected: str,
    keep: bool = False,
    tries: int = 3,
) -> Result:
    tag = "x" if faults else "ff"
    name = f"fc{os.getpid() % 10000}-{launcher[0]}{sched.index}{tag}"
    root = base / name
    spec = sched.spec(root) if faults else ""
    started = time.monotonic()
    launchers = _launch(sched, launcher, root, name, spec)
    hung = False
    for p in launchers:
        try:
            p.wait(max(0.1, deadline_s - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            hung = True
            break
    wall = time.monotonic() - started
    if hung:
        _kill_all(root, launchers)
    time.sleep(1.0)  # the launchers' children get their parent-death signal
    orphans = _ours(root)
    for proc in orphans:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    codes = [p.wait(10) for p in launchers]
    # A hung job was SIGKILLed whole by this benchmark: what it left is not its leak.
    leaks = [] if hung else _leaks(name, root)
    if os.path.ismount(root / "shm"):
        subprocess.run(["umount", "-l", str(root / "shm")], check=False)
    if os.path.ismount(root / "ckpt"):
        # The storage left is checked below on a copy: the mount goes with the job.
        shutil.copytree(root / "ckpt", root / "ckpt.kept", symlinks=True)
        subprocess.run(["umount", "-l", str(root / "ckpt")], check=False)
        shutil.rmtree(root / "ckpt")
        (root / "ckpt.kept").rename(root / "ckpt")
    log = _logs(root)
    if launcher == "torchrun" and tries > 1 and any(codes) and PORT_TAKEN in log:
        # Not the schedule's doing: the free port picked for the rendezvous was bound by
        # another process before torchrun's store could (a busy machine). Run it again.
        print(f"<!-- job {sched.index} torchrun: its rendezvous port was taken; again -->",
              file=sys.stderr)  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)
        return run_job(sched, launcher, base, faults, deadline_s, expected, keep, tries - 1)
    final_path = root / "out.final"
    final = json.loads(final_path.read_text()) if final_path.exists() else None
    result = Result("", wall, orphans=0 if hung else len(orphans), leaks=leaks)
    ok = all(c == 0 for c in codes)
    if hung:
        result.verdict = "hung"
    elif sched.should_fail and faults:
        [(rank, step)] = [(r, s) for k, r, s in sched.faults if k == "exception_twice"][:1]
        raises = len(re.findall(rf"dlrover fault injection: raise rank {rank} step {step}\b", log))
        named = "InjectedFault" in log
        if ok:
            result.verdict, result.note = "wrong", "ended 0 though it should fail"
        elif named:
            result.verdict = "failed fast" if raises <= 2 else "failed late"
            result.note = f"{raises} raises"
        else:
            result.verdict, result.note = "wrong", "failed without naming the exception"
    elif ok and final is not None:
        result.lost, result.duplicated = final["lost"], final["duplicated"]
        same = final["hash"] == expected
        result.verdict = "completed" if same else "wrong"
        result.torn = _verify_checkpoint(root, final["hash"])
    else:
        result.verdict, result.note = "wrong", f"exit codes {codes}"
    if keep or result.verdict == "wrong" or result.verdict == "hung":
        result.note += f" (kept: {root})"
    else:
        shutil.rmtree(root, ignore_errors=True)
    return result


def _not_run(sched: Schedule, launcher: str, no_cgroup: str, no_small_disk: str) -> str:
    """Why ``sched`` does not run under ``launcher`` here ("" where it does)."""
    if launcher == "torchrun" and not all(KINDS[k].torchrun for k, _, _ in sched.faults):
        return "n/a"
    if sched.needs_cgroup and no_cgroup:
        # Without a node memory limit the oom fault would take the machine's memory.
        return f"skipped (worker_oom needs a cgroup: {no_cgroup})"
    if sched.needs_small_disk and no_small_disk:
        # Filling the real disk would hurt everything else on the machine.
        return f"skipped (disk_full needs a tmpfs mount: {no_small_disk})"
    if sched.needs_small_shm and no_small_disk:
        return f"skipped (shm_full needs a tmpfs mount: {no_small_disk})"
    return ""


def _mount_small(where: Path, size: str = SMALL_DISK) -> None:
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        check=True,
        capture_output=True,
    )


def _small_disk_missing() -> str:
    """Why no small filesystem can be mounted here ("" where one can: root)."""
    with tempfile.TemporaryDirectory() as probe:
        try:
            _mount_small(Path(probe))
        except (OSError, subprocess.CalledProcessError) as exc:
            return getattr(exc, "stderr", b"").decode(errors="replace").strip() or str(exc)
        subprocess.run(["umount", probe], check=False)
    return ""


def _cgroups_missing() -> str:
    """Why no node memory limit can be set on this machine ("" where one can)."""
    from dlrover.engines.cgroups import CgroupRoot

    root, why = CgroupRoot.detect()
    return "" if root is not None else why


def expected_hash() -> str:
    import torch

    from dlrover.testing.digest import tensors_digest

    return tensors_digest([torch.ones(SAMPLES, dtype=torch.int64)])


def _logs(root: Path) -> str:
    """The launcher's output, every node's agent and every rank's (dlrover submit keeps those
    under its home: a node's std* files, its ranks' in ranks/<run>/attempt_<n>/rank_<r>/)."""
    parts = [p.read_text(errors="replace") for p in [root / "launcher.log"] if p.exists()]
    parts += [p.read_text(errors="replace") for p in sorted(root.glob("home/jobs/*/nodes/*/std*"))]
    ranks = sorted(root.glob("home/jobs/*/nodes/*/ranks/*/*/*/*.log"))
    parts += [p.read_text(errors="replace") for p in ranks]
    return "\n".join(parts)


def _pct(part: int, whole: int) -> str:
    return f"{part}/{whole} ({100 * part / whole:.0f}%)" if whole else "-"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=50)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--deadline-s", type=float, default=240.0, help="per job, then it is hung")
    p.add_argument("--no-torchrun", action="store_true", help="dlrover only")
    p.add_argument("--json", default="", help="also write every job's result to this file")
    p.add_argument("--only", type=int, nargs="+", default=[], help="run only these jobs (index)")
    p.add_argument("--list", action="store_true", help="print the schedules and run nothing")
    p.add_argument("--keep", action="store_true", help="keep every job's folder (logs, homes)")
    a = p.parse_args()
    launchers = ["dlrover"] + ([] if a.no_torchrun else ["torchrun"])
    rng = random.Random(a.seed)
    # Every job is drawn, so that --only N runs the same schedule as job N of a full campaign.
    schedules: list[Schedule | jobs.OtherSchedule] = [
        draw(rng, i) if jobs.job_type(i) == "allreduce" else jobs.draw(rng, i)
        for i in range(a.jobs)
    ]
    if a.list:
        print(f"(jobs i with i % {jobs.EVERY} == 4 are stream jobs, == 5 PS jobs)")
        for s in schedules:
            if isinstance(s, jobs.OtherSchedule):
                print(s.listing())
                continue
            print(f"{s.index}: {s.nodes} nodes, {s.steps} steps: {s.describe()}")
        return
    if a.only:
        unknown = sorted(set(a.only) - set(range(a.jobs)))
        if unknown:
            raise SystemExit(f"--only {unknown}: the campaign has jobs 0..{a.jobs - 1}")
        schedules = [s for s in schedules if s.index in a.only]
    expected = expected_hash()
    no_cgroup = _cgroups_missing()
    no_small_disk = _small_disk_missing()
    no_stream = jobs.stream_missing()
    others = jobs.OtherJobs(jobs.Harness(_env, _ours, _leaks, _verify_checkpoint, Result))
    base = Path(tempfile.mkdtemp(prefix="dlrover-campaign-"))
    started = time.monotonic()
    # Failure-free runs of each launcher and size: the model to match and the goodput floor.
    floor: dict[tuple[str, int | str], float] = {}
    for launcher in launchers:
        for nodes in sorted({s.nodes for s in schedules if isinstance(s, Schedule)}):
            r = run_job(Schedule(nodes, nodes, []), launcher, base, False, a.deadline_s, expected)
            if r.verdict != "completed":
                raise SystemExit(f"the failure-free {launcher} run of {nodes} nodes: {r}")
            floor[(launcher, nodes)] = r.wall_s
        for ref in jobs.failure_free(schedules):
            if others.not_run(ref, launcher, no_stream):
                continue
            r = others.run(ref, base, False, a.deadline_s, False)
            if r.verdict != "completed":
                raise SystemExit(f"the failure-free {launcher} {ref.nodes} run: {r}")
            floor[(launcher, ref.nodes)] = r.wall_s
    results: dict[str, list[Result | None]] = {launcher: [] for launcher in launchers}
    print(
        f"seed {a.seed}, {len(schedules)} of {a.jobs} jobs; failure-free wall s: "
        + ", ".join(f"{who} {n} nodes {s:.1f}" for (who, n), s in floor.items()),
        flush=True,
    )
    header = ["job", "nodes", "faults"] + [
        f"{who} {c}" for who in launchers for c in ("verdict", "goodput")
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    not_run: dict[tuple[str, int], str] = {}
    for sched in schedules:
        row = [str(sched.index), str(sched.nodes), sched.describe()]
        for launcher in launchers:
            why_not = (
                others.not_run(sched, launcher, no_stream)
                if isinstance(sched, jobs.OtherSchedule)
                else _not_run(sched, launcher, no_cgroup, no_small_disk)
            )
            if why_not:
                results[launcher].append(None)
                not_run[(launcher, sched.index)] = why_not
                row += [why_not, "-"]
                continue
            if isinstance(sched, jobs.OtherSchedule):
                r = others.run(sched, base, True, a.deadline_s, a.keep)
            else:
                r = run_job(sched, launcher, base, True, a.deadline_s, expected, a.keep)
            results[launcher].append(r)
            extra = []
            if r.lost or r.duplicated:
                extra.append(f"lost {r.lost} dup {r.duplicated}")
            if r.torn:
                extra.append("torn ckpt")
            if r.orphans:
                extra.append(f"{r.orphans} orphans")
            if r.leaks:
                extra.append(f"leaked {len(r.leaks)}")
            verdict = r.verdict + (f" ({'; '.join(extra)})" if extra else "")
            goodput = (
                floor[(launcher, sched.nodes)] / r.wall_s if r.verdict == "completed" else None
            )
            row += [verdict, f"{goodput:.0%}" if goodput is not None else "-"]
            if r.note and (r.verdict in ("wrong", "hung") or "not reached" in r.note):
                print(f"<!-- job {sched.index} {launcher}: {r.note} -->", file=sys.stderr)
        print("| " + " | ".join(row) + " |", flush=True)
    print()
    summary(schedules, results, floor)
    print(f"\n{time.monotonic() - started:.0f}s")
    kept = [p for p in base.iterdir()] if base.exists() else []
    if kept:
        print(f"kept for a look: {', '.join(map(str, kept))}", file=sys.stderr)
    if a.json:
        rows = [
            {"job": s.index, "faults": s.describe(), "should_fail": s.should_fail,
             "launcher": launcher,
             **(dataclasses.asdict(r) if r is not None
                else {"verdict": "not run", "note": not_run[(launcher, s.index)]})}
            for launcher, rs in results.items()
            for s, r in zip(schedules, rs, strict=True)
        ]  # fmt: skip
        Path(a.json).write_text(json.dumps(rows, indent=1))
    if not kept:
        base.rmdir()


def summary(
    schedules: list[Schedule | jobs.OtherSchedule],
    results: dict[str, list[Result | None]],
    floor: dict[tuple[str, int | str], float],
) -> None:
    """Per launcher: completion of should-complete jobs, fail-fast of should-fail ones, the
    oracle's counts; then goodput per fault class."""
    print("| launcher | should complete: completed | should fail: failed fast | hung | "
          "lost / duplicated samples | torn ckpts | orphans | leaks |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    lines = []
    for launcher, rs in results.items():
        ran = [(s, r) for s, r in zip(schedules, rs, strict=True) if r is not None]
        complete = [r for s, r in ran if not s.should_fail]
        fail = [r for s, r in ran if s.should_fail]
        done = sum(r.verdict == "completed" for r in complete)
        fast = sum(r.verdict == "failed fast" for r in fail)
        hung = sum(r.verdict == "hung" for _, r in ran)
        lost = sum(r.lost for _, r in ran)
        dup = sum(r.duplicated for _, r in ran)
        torn = sum(r.torn for _, r in ran)
        orphans = sum(r.orphans for _, r in ran)
        leaks = sum(len(r.leaks) for _, r in ran)
        print(f"| {launcher} | {_pct(done, len(complete))} | {_pct(fast, len(fail))} | {hung} | "
              f"{lost} / {dup} | {torn} | {orphans} | {leaks} |")  # fmt: skip
        lines.append(
            f"{launcher}: {done}/{len(complete)} completed with the failure-free model, "
            f"{fast}/{len(fail)} failed fast, {hung} hung"
        )
    print("\nGoodput per fault class (completed jobs that had it; failure-free wall / wall):\n")
    print("| fault class | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for kind in [*KINDS, *jobs.KINDS]:
        cells = []
        for launcher, rs in results.items():
            values = [
                floor[(launcher, s.nodes)] / r.wall_s
                for s, r in zip(schedules, rs, strict=True)
                if r is not None
                and r.verdict == "completed"
                and any(k == kind for k, _, _ in s.faults)
            ]
            cells.append(f"{sum(values) / len(values):.0%} ({len(values)})" if values else "-")
        print(f"| {kind} | " + " | ".join(cells) + " |")
    print("\n" + "; ".join(lines))


if __name__ == "__main__":
    main()
