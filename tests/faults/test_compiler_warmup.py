"""A zygote that warmed inductor's compiler forks workers that skip its set-up: no import of the
compiler, no probe of the machine (the C++ compiler's version, the vector instruction sets), each
of which costs a fresh process subprocesses before its first compiled step."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlrover.agent.zygote import Zygote
from dlrover.constants import ENV_COMPILE_MARKER
from tests.conftest import clean_env, dlrover_run

DEADLINE_S = 120.0

# A compiled function, run after the script records what its process had before it compiled and
# which subprocesses the compile started (torch's probes run through subprocess).
FIRST_GRAPH_SET_UP = """
from torch._inductor import codecache
from torch._inductor.fx_passes import joint_graph
# What inductor sets up at its first graph: the hash of torch's sources (build_code_hash, called
# only while torch_key is not kept yet), the pattern passes.
hashing = []
_hash = codecache.build_code_hash
def _count(*args, **kw):
    hashing.append(1)
    return _hash(*args, **kw)
codecache.build_code_hash = _count
patterns = joint_graph.lazy_init.cache_info().currsize > 0
"""
"""Sets ``hashing`` (empty: torch's source hash was kept already) and ``patterns`` (the pattern
passes were registered already), before the script's compile."""

COMPILE = (
    """
import json, subprocess, sys
import torch
had_compiler = "torch._inductor.compile_fx" in sys.modules
"""
    + FIRST_GRAPH_SET_UP
    + """started = []
_init = subprocess.Popen.__init__
def _record(self, args, *rest, **kw):
    started.append(args if isinstance(args, str) else " ".join(map(str, args)))
    _init(self, args, *rest, **kw)
subprocess.Popen.__init__ = _record
y = torch.compile(lambda x: x * 2 + 1)(torch.arange(4.0))
print(json.dumps({"had_compiler": had_compiler, "hashed": not hashing, "patterns": patterns,
                  "started": started, "y": y.tolist()}))
"""
)


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    # Precompiled headers off, as --compile-cache has them: with them on, each process also
    # preprocesses inductor's header once (about 0.1 s), which no warm-up takes over.
    return clean_env(
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
        TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS="0",
        **extra,
    )


@pytest.fixture()
def zygote(tmp_path: Path) -> Iterator[Zygote]:
    env = _env(tmp_path)
    started = Zygote.start(timeout=DEADLINE_S, env=env)
    yield started
    started.close()


def _run(zygote: Zygote, tmp_path: Path, name: str) -> dict[str, object]:
    script = tmp_path / "compile.py"
    script.write_text(COMPILE)
    out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
    env = _env(tmp_path, **{ENV_COMPILE_MARKER: str(tmp_path / "compiles")})
    handle = zygote.spawn([str(script)], env, tmp_path, out, err)
    assert handle.wait(DEADLINE_S) == 0, err.read_text()[-3000:]
    result: dict[str, object] = json.loads(out.read_text().strip().splitlines()[-1])
    return result


# A cold compile and a warmed one, each in a forked worker: about 20 s on a slow 2-core machine,
# over the fast stage's bound.
@pytest.mark.e2e
@pytest.mark.long
def test_workers_forked_after_the_warm_up_skip_the_compilers_set_up(
    zygote: Zygote, tmp_path: Path
) -> None:
    first = _run(zygote, tmp_path, "first")
    # The worker's torch.compile left the marker the agent waits for; it set the compiler up
    # itself (its probes started subprocesses).
    assert (tmp_path / "compiles").exists()
    assert first["had_compiler"] is False
    assert first["hashed"] is False and first["patterns"] is False
    assert first["started"], "a cold process probes the machine through subprocesses"

    threads = _threads(zygote.pid)
    zygote.warm_compiler()
    # Sent at once behind the warm-up: the zygote answers in order, so it forks warm.
    second = _run(zygote, tmp_path, "second")
    warmup = zygote.wait_warmed(0)
    assert warmup is not None and warmup.error == "", warmup
    assert warmup.seconds > 0
    assert _threads(zygote.pid) == threads, "the warm-up left a thread: forking is unsafe"

    assert second["had_compiler"] is True
    # This torch is a CPU build: the joint-graph patterns of the CPU are registered too.
    assert second["hashed"] is True and second["patterns"] is True
    assert second["started"] == [], "the warmed worker still probed the machine"
    assert second["y"] == first["y"] == [1.0, 3.0, 5.0, 7.0]


@pytest.mark.extras
def test_where_tqdm_is_installed_the_warm_up_leaves_no_thread_and_workers_fork_warm(
    zygote: Zygote, tmp_path: Path
) -> None:
    """tqdm (installed beside Hugging Face and most training stacks) starts a monitor thread on
    its first progress bar, and torch.fx opens a disabled one for each graph the joint-graph
    patterns trace: the warm-up left that thread in the zygote, which then refused every fork.
    The warm-up stops the monitor it started; a worker forked after it is warm, and its own
    first bar starts its own monitor."""
    pytest.importorskip("tqdm", reason="tqdm is not installed (pip install tqdm)")
    threads = _threads(zygote.pid)
    zygote.warm_compiler()
    warmup = zygote.wait_warmed(DEADLINE_S)
    assert warmup is not None and warmup.error == "", warmup
    assert _threads(zygote.pid) == threads, "the warm-up left a thread: forking is unsafe"
    script = tmp_path / "bar.py"
    script.write_text(
        "import sys, threading\n"
        "from tqdm import tqdm\n"
        "warm = 'torch._inductor.compile_fx' in sys.modules\n"
        "with tqdm(total=2, file=sys.stderr) as bar:\n"
        "    bar.update(2)\n"
        "    names = [t.name for t in threading.enumerate()]\n"
        "print(warm, 'tqdm_monitor' in names)\n"
    )
    out, err = tmp_path / "bar.out", tmp_path / "bar.err"
    handle = zygote.spawn([str(script)], _env(tmp_path), tmp_path, out, err)
    assert handle.wait(DEADLINE_S) == 0, err.read_text()[-3000:]
    assert out.read_text().split() == ["True", "True"]


def test_a_warm_up_that_cannot_import_the_compiler_says_why_and_the_zygote_serves_on(
    tmp_path: Path,
) -> None:
    # A shadow `torch` package without inductor: the warm-up's import fails, nothing else does.
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "from types import SimpleNamespace\ncuda = SimpleNamespace(is_initialized=lambda: False)\n"
    )
    env = clean_env(PYTHONPATH=f"{fake.parent}{os.pathsep}{clean_env()['PYTHONPATH']}")
    zygote = Zygote.start(preload=("torch",), timeout=DEADLINE_S, env=env)
    try:
        zygote.warm_compiler()
        warmup = zygote.wait_warmed(DEADLINE_S)
        assert warmup is not None and "ModuleNotFoundError" in warmup.error, warmup
        script = tmp_path / "ok.py"
        script.write_text("print('forked')\n")
        out = tmp_path / "ok.out"
        handle = zygote.spawn([str(script)], env, tmp_path, out, tmp_path / "ok.err")
        assert handle.wait(DEADLINE_S) == 0
        assert out.read_text() == "forked\n"
    finally:
        zygote.close()


RESTARTED = (
    """
import json, os, sys
import torch
from dlrover.testing.faults import maybe_inject
had_compiler = "torch._inductor.compile_fx" in sys.modules
"""
    + FIRST_GRAPH_SET_UP
    + """
y = torch.compile(lambda x: x * 2 + 1)(torch.arange(4.0))
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
                        "had_compiler": had_compiler, "hashed": not hashing,
                        "patterns": patterns, "y": y.tolist()}) + "\\n")
maybe_inject(0)
"""
)


@pytest.mark.e2e
@pytest.mark.parametrize("warm", ["1", "0"])
def test_a_restarted_worker_of_a_compiling_script_forks_from_a_warmed_zygote(
    tmp_path: Path, warm: str
) -> None:
    """An unchanged script under dlrover-run: its first worker compiles and is killed; the
    agent saw it compile, so its restart forks from a zygote that warmed the compiler (unless
    DLROVER_ZYGOTE_WARM_COMPILER=0)."""
    script = tmp_path / "train.py"
    script.write_text(RESTARTED)
    rows = tmp_path / "rows.jsonl"
    env = clean_env(
        DLROVER_FAULTS="kill:rank=0:step=0:restart=0",
        TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
        DLROVER_ZYGOTE_WARM_COMPILER=warm,
    )
    done = dlrover_run(
        ["--standalone", "--nproc_per_node=1", "--max-restarts=1", str(script), str(rows)],
        env=env,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    runs = [json.loads(line) for line in rows.read_text().splitlines()]
    assert [r["restart"] for r in runs] == [0, 1]
    assert [r["had_compiler"] for r in runs] == [False, warm == "1"]
    assert [r["hashed"] for r in runs] == [False, warm == "1"]
    assert [r["patterns"] for r in runs] == [False, warm == "1"]
    assert runs[0]["y"] == runs[1]["y"]
    warmed = re.search(r"compiler warmed in [\d.]+ s", done.stderr)
    assert bool(warmed) == (warm == "1"), done.stderr[-4000:]
