"""In-process recovery end to end: real agents, real gloo, a compiled transformer under DDP.

The script (tests/scripts/inprocess_train.py) wraps its training function in
`dlrover.trainer.torch.inprocess.Wrapper`; every process appends a line at each entry of that
function (rank, pid, first step, where it loaded from, recoveries), so a test sees which
processes survived. The oracle is the same job without faults: the final parameters must be
its, bit for bit.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dlrover.client.master_client import MasterClient
from tests.conftest import REPO, SCRIPTS, MasterProcess, clean_env, dlrover_run, run_cmd
from tests.stalls import end_all, until

SCRIPT = str(SCRIPTS / "inprocess_train.py")
pytestmark = pytest.mark.e2e


def run(
    tmp: Path, name: str, steps: int, faults: str = "", *extra: str, script: str = SCRIPT
) -> Path:
    """``dlrover-run --standalone`` with 2 ranks; the output prefix (its log: ``<out>.log``)."""
    out = tmp / name
    r = dlrover_run(
        [
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=3",
            script,
            "--steps",
            str(steps),
            "--ckpt",
            str(tmp / f"{name}-ckpt"),
            "--out",
            str(out),
            *extra,
        ],
        env=clean_env(DLROVER_FAULTS=faults),
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-6000:]
    Path(f"{out}.log").write_text(r.stderr)
    return out


def entries(out: Path) -> list[tuple[int, int, int, str, int]]:
    """(rank, pid, first step, loaded from, recoveries) of every entry of the function."""
    rows = (line.split() for line in Path(f"{out}.entries").read_text().splitlines())
    return [(int(r), int(p), int(s), src, int(n)) for r, p, s, src, n, _ in rows]


def steps(out: Path) -> list[tuple[int, float, int]]:
    """(step, time, world size) of every step rank 0 completed."""
    rows = (line.split() for line in Path(f"{out}.steps").read_text().splitlines())
    return [(int(s), float(t), int(w)) for s, t, w in rows]


def final(out: Path) -> str:
    return Path(f"{out}.final").read_text()


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The failure-free run's final parameters (20 steps)."""
    return final(run(tmp_path_factory.mktemp("oracle"), "oracle", 20))


def test_survivors_keep_their_processes_through_random_kills(tmp_path: Path, oracle: str):
    """Three kills at random steps and ranks: each replaces exactly the killed process, the
    other keeps its pid, and every rank heals from memory to the failure-free model."""
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    at = sorted(rng.sample(range(2, 19), 3))
    ranks = [rng.randrange(2) for _ in at]
    faults = ";".join(
        f"kill:rank={r}:step={s}:restart={i}"
        for i, (r, s) in enumerate(zip(ranks, at, strict=True))
    )
    out = run(tmp_path, "killed", 20, faults)
    assert final(out) == oracle, f"seed {seed}: {faults}"

    seen = entries(out)
    pids = {rank: [pid for r, pid, *_ in seen if r == rank] for rank in (0, 1)}
    for i, killed in enumerate(ranks):
        survivor = 1 - killed
        # Entry i+1 of the survivor is a re-entry of the same process after kill i.
        assert pids[survivor][i + 1] == pids[survivor][i], (seed, faults, seen)
        assert pids[killed][i + 1] != pids[killed][i], (seed, faults, seen)
    assert len({pid for _, pid, *_ in seen}) == 2 + len(at), (seed, faults, seen)
    resumed = [row for row in seen if row[2] > 1]
    assert all(src == "memory" for _, _, _, src, _ in resumed), (seed, faults, seen)
    # Nobody went back further than the step the kill hit: each kill at step s resumes at s.
    assert sorted({s for _, _, s, *_ in resumed}) == at, (seed, faults, seen)
    assert [s for s, _, _ in steps(out)] == list(range(1, 21)), (seed, faults)
    # Each failure is recorded once, as recovered in-process (`dlrover diagnose`, the metrics).
    assert Path(f"{out}.log").read_text().count("-> recover_in_process") == 3


def test_an_elastic_trainer_loop_keeps_its_survivors_and_ends_with_the_failure_free_model(
    tmp_path: Path,
):
    """DLRover's own API (ElasticTrainer, ElasticDistributedSampler, DdpCheckpointer) in the
    wrapper: rank 1 killed after step 4, then rank 0 after step 9. Each time the other rank
    keeps its process, every rank goes back to the newest saved step (the sampler with it), and
    the final model is the failure-free run's bit for bit."""
    elastic = str(SCRIPTS / "inprocess_elastic.py")
    oracle = final(run(tmp_path, "elastic-oracle", 12, script=elastic))
    faults = "kill:rank=1:step=4:restart=0;kill:rank=0:step=9:restart=1"
    out = run(tmp_path, "elastic", 12, faults, script=elastic)
    assert final(out) == oracle
    rows = [line.split() for line in Path(f"{out}.entries").read_text().splitlines()]
    seen = [(int(r), int(p), int(s)) for r, p, s in rows]
    pids = {rank: [pid for r, pid, _ in seen if r == rank] for rank in (0, 1)}
    assert pids[0][0] == pids[0][1] != pids[0][2], seen  # kept through kill 1, killed at 2
    assert pids[1][0] != pids[1][1] == pids[1][2], seen  # killed at 1, kept through kill 2
    # Rank 1 died after step 4 but rank 0 had saved it (DDP's state is rank 0's copy): every
    # rank goes on at step 5. Rank 0 died after step 9 before saving it: both run 9 again (rank
    # 1 with the cut step's gradients dropped, which ElasticTrainer.step does on the failure).
    assert sorted({s for _, _, s in seen}) == [1, 5, 9], seen


def test_an_elastic_trainer_loop_over_dynamic_shards_trains_every_sample_once(tmp_path: Path):
    """The same loop over DynamicShardSampler (shards leased from the master, exactly once), for
    a whole epoch (32 steps of 8 of the 256 samples), rank 1 killed after step 5 and rank 0
    after step 9: each time the other rank keeps its process, and the steps every rank
    finished hold each sample exactly once (a step cut by a failure and run again counts by its
    last run). Dynamic shards do not keep the failure-free run's order (a lost rank's leased
    shards go back to the queue), so the model is not compared bit for bit here."""
    elastic = str(SCRIPTS / "inprocess_elastic.py")
    # Rank 1 dies after step 5, which rank 0 saved: 20 samples a rank, two shards and a half
    # (exactly once resumes inside the half; at least once would train it again).
    faults = "kill:rank=1:step=5:restart=0;kill:rank=0:step=9:restart=1"
    out = run(tmp_path, "dynamic", 32, faults, "--sampler", "dynamic", script=elastic)
    rows = [line.split() for line in Path(f"{out}.entries").read_text().splitlines()]
    seen = [(int(r), int(p), int(s)) for r, p, s in rows]
    pids = {rank: [pid for r, pid, _ in seen if r == rank] for rank in (0, 1)}
    assert pids[0][0] == pids[0][1] != pids[0][2], seen
    assert pids[1][0] != pids[1][1] == pids[1][2], seen
    trained: dict[tuple[int, int], list[int]] = {}
    for line in Path(f"{out}.ids").read_text().splitlines():
        step, rank, *ids = line.split()
        trained[int(step), int(rank)] = [int(i) for i in ids]  # a re-run step: its last run
    assert sorted(trained) == [(s, r) for s in range(1, 33) for r in (0, 1)], sorted(trained)
    assert sorted(i for ids in trained.values() for i in ids) == list(range(256))


def test_with_shrink_the_survivor_goes_on_at_once_and_the_replacement_joins_later(
    tmp_path: Path, oracle: str
):
    """``Wrapper(shrink=True)``: rank 1 killed at step 5; rank 0 trains steps 5..9 alone,
    taking rank 1's data (world size 1), without waiting for the replacement to start and
    compile; the replacement joins at the end of step 9 (the script holds there until it has),
    and the model is still the failure-free one bit for bit."""
    out = run(
        tmp_path, "shrunk", 20, "kill:rank=1:step=5:restart=0", "--shrink", "--hold-shrunk-at", "9"
    )
    assert final(out) == oracle

    seen = entries(out)
    survivor = [pid for r, pid, *_ in seen if r == 0]
    assert len(set(survivor)) == 1, seen  # rank 0 never restarted: 3 entries, one process
    assert [s for r, _, s, *_ in seen if r == 0] == [1, 5, 10], seen
    world = {s: w for s, _, w in steps(out)}
    assert [world[s] for s in range(1, 21)] == [2] * 4 + [1] * 5 + [2] * 11, world


def test_a_replacement_that_fails_before_it_joins_is_replaced_while_the_survivor_goes_on(
    tmp_path: Path, oracle: str
):
    """Shrink: rank 1 killed at step 5; its replacement dies as it starts (step 0 of restart
    1), before it could join; the agent starts another while rank 0 trains on alone, and that
    one joins at the end of step 9: rank 0 never leaves its process, and the model is the
    failure-free one."""
    faults = "kill:rank=1:step=5:restart=0;kill:rank=1:step=0:restart=1"
    out = run(tmp_path, "twice", 20, faults, "--shrink", "--hold-shrunk-at", "9")
    assert final(out) == oracle

    seen = entries(out)
    assert len({pid for r, pid, *_ in seen if r == 0}) == 1, seen
    assert [s for r, _, s, *_ in seen if r == 0] == [1, 5, 10], seen
    assert [s for r, _, s, *_ in seen if r == 1] == [1, 10], seen  # the first one never entered
    assert Path(f"{out}.log").read_text().count("-> recover_in_process") == 2


@pytest.mark.long
def test_a_replacement_on_a_fresh_machine_compiles_from_the_job_s_cache(tmp_path: Path):
    """Machines are told apart by their TMPDIR, where torch keeps its caches by default.

    ``--compile-cache master``, no shared folder: node A compiles from scratch and its agent
    sends the cache entries to the master; node B joins later on a fresh machine, fetches them
    before its worker starts, and compiles none of its graphs: its first step is far from A's
    cold compile (benchmarks/compile_cache.py times such a machine against a warm one).
    ``--compile-cache DIR``, a shared folder: a job on a fresh machine C whose folder is the
    one A filled compiles nothing either. (One cold compile in the test: they cost the most.)"""
    master = MasterProcess(tmp_path)
    client = MasterClient(master.vars["DLROVER_MASTER_ADDR"], master.vars["DLROVER_JOB_TOKEN"])
    out, nodes = tmp_path / "job", []

    def node(machine: str) -> subprocess.Popen[bytes]:
        (tmp_path / machine).mkdir()
        log = (tmp_path / f"{machine}.log").open("w")
        return subprocess.Popen(
            [
                *run_cmd("dlrover.cli.run"),
                "--nnodes=1:2",
                "--nproc-per-node=1",
                "--compile-cache=master",
                SCRIPT,
                *("--steps", "300", "--step-time", "0.05", "--compile", "inductor"),
                *("--layers", "0", "--ckpt", str(tmp_path / "ckpt"), "--out", str(out)),
            ],
            env=clean_env(TMPDIR=str(tmp_path / machine), **master.vars),
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    def first_steps() -> dict[int, list[tuple[float, int]]]:
        """Per rank, each process's first step: (seconds, graphs inductor compiled anew)."""
        rows = [line.split() for line in read_or_empty(Path(f"{out}.first")).splitlines()]
        found: dict[int, list[tuple[float, int]]] = {}
        for rank, _, seconds, compiled in rows:
            found.setdefault(int(rank), []).append((float(seconds), int(compiled)))
        return found

    try:
        nodes.append(node("machine-a"))
        until(lambda: 0 in first_steps(), "node A's first step", nodes, 300)
        cold, compiled_by_a = first_steps()[0][0]
        counts: list[int] = []  # node A's entries reach the master once they settled

        def settled() -> bool:
            counts.append(len(client.cache_files()))
            return len(counts) > 4 and counts[-1] == counts[-5] > 0

        until(settled, "node A's cache entries on the master", nodes, 60, every_s=1.0)
        nodes.append(node("machine-b"))
        until(lambda: 1 in first_steps(), "node B's first step", nodes, 300)
    finally:  # what is measured is done: the rest of the job is not this test's subject
        end_all(nodes)
        client.close()
        master.close()
    joined, compiled_by_b = first_steps()[1][0]
    said_b = (tmp_path / "machine-b.log").read_text()
    assert re.search(r"compile cache: fetched \d+ files", said_b), said_b[-4000:]
    assert not list((tmp_path / "machine-b").glob("torchinductor_*")), "B compiled elsewhere"
    # Whether a process compiled is counted, not timed (one timing on a busy machine proves
    # little): A compiled its graphs, B found every one of them in what it fetched.
    assert compiled_by_a > 0 and compiled_by_b == 0, (compiled_by_a, compiled_by_b)
    assert joined < cold / 3, (joined, cold)

    # The shared folder: the files A wrote, reached by a fresh machine C through the filesystem.
    (folder,) = (tmp_path / "machine-a").glob("dlrover-compile-cache-*")
    (tmp_path / "machine-c").mkdir()
    r = dlrover_run(
        [
            "--standalone",
            "--nproc-per-node=1",
            f"--compile-cache={folder}",
            SCRIPT,
            *("--steps", "2", "--compile", "inductor", "--layers", "0"),
            *("--ckpt", str(tmp_path / "c-ckpt"), "--out", str(tmp_path / "c")),
        ],
        env=clean_env(TMPDIR=str(tmp_path / "machine-c")),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-6000:]
    (_, _, shared, compiled_by_c) = Path(f"{tmp_path / 'c'}.first").read_text().split()
    assert int(compiled_by_c) == 0 and float(shared) < cold / 3, (compiled_by_c, shared, cold)


def read_or_empty(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def submit(tmp: Path, name: str, faults: str, *extra: str) -> tuple[Path, str]:
    """``dlrover submit`` of two nodes with one worker each (local engine); the output prefix
    and the master's log."""
    home = tmp / "home"
    out = tmp / name
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dlrover.cli.job",
            "submit",
            "--name",
            name,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "3",
            *extra,
            SCRIPT,
            "--steps",
            "20",
            "--ckpt",
            str(tmp / "ckpt"),
            "--out",
            str(out),
            "--replica-count",
            "1",
        ],
        # One thread, as the oracle's two workers on one node get: the sums inside a matmul
        # then run in the same order.
        env=clean_env(DLROVER_HOME=str(home), DLROVER_FAULTS=faults, OMP_NUM_THREADS="1"),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode != 0:
        logs = sorted((home / "jobs").glob("*/nodes/*/std*"))
        shown = "\n".join(f"==== {p}\n{p.read_text()[-3000:]}" for p in logs)
        raise AssertionError(f"{r.stdout}\n{r.stderr}\n{shown}")
    return out, r.stdout + r.stderr


def test_a_node_whose_peer_node_fails_keeps_its_process(tmp_path: Path, oracle: str):
    """Two nodes of one worker each (`dlrover submit`, local engine): node 1's worker is
    killed; node 0's worker leaves its failed collective and goes on in its own process once
    node 1's replacement is up; the model is the failure-free one."""
    out, _ = submit(tmp_path, "twonodes", "kill:rank=1:step=7:restart=0")
    assert final(out) == oracle

    seen = entries(out)
    node0 = [pid for rank, pid, *_ in seen if rank == 0]
    assert len(node0) == 2 and node0[0] == node0[1], seen
    assert [s for rank, _, s, *_ in seen if rank == 0] == [1, 7], seen


def test_a_hot_spare_takes_a_lost_node_s_place_without_a_launch(tmp_path: Path, oracle: str):
    """``--spares 1``: three nodes launched for a job of two; the one left out waits. Node 1's
    machine is lost at step 7 (agent, memory and worker gone): the next round takes the
    survivor and the spare, not the lost node's replacement (launched after the loss), the
    survivor keeps its process, the spare loads step 6 from the survivor's memory, and the
    model is the failure-free one."""
    out, log = submit(
        tmp_path, "spares", f"lose_node:rank=1:step=7:once={tmp_path / 'once'}", "--spares", "1"
    )
    assert final(out) == oracle

    stamp = r"(\d\d:\d\d:\d\d\.\d+)"
    closed = sorted(re.findall(stamp + r" .*round (\d+) closed .*: (.*)", log))
    lost = re.search(stamp + r" .*node (\S+): running -> lost", log)
    replacement = re.search(stamp + r" .*node (\S+-1): registered", log)
    assert lost is not None and replacement is not None, log[-4000:]
    before = [c for c in closed if c[0] < lost[1]]
    after = [c for c in closed if c[0] > lost[1]]
    assert before and after, closed

    def members(round_line: tuple[str, str, str]) -> set[str]:
        return {m.split("=")[0] for m in round_line[2].split(", ")}

    # The first round after the loss kept the survivor and took a node launched at the start
    # (the spare, attempt 0) in the lost node's place: the lost node's replacement, launched
    # after the loss, was not waited for (it waits as the next spare).
    survivors = members(before[-1]) - {lost[2]}
    taken = members(after[0]) - members(before[-1])
    assert survivors <= members(after[0]), (closed, lost[2])
    assert taken and all(node.endswith("-0") for node in taken), (closed, lost[2])
    assert replacement[2] not in members(after[0]), (closed, replacement[0])

    seen = entries(out)
    survivor = [pid for rank, pid, *_ in seen if rank == 0]
    assert len(survivor) == 2 and survivor[0] == survivor[1], seen
    assert [(s, src) for rank, _, s, src, _ in seen if rank == 1][-1] == (7, "memory"), seen
