"""A compile cache shared by a job's machines: the first step of a compiled model, cold, on a
fresh machine with the shared cache warm, and on a machine with its own cache warm; with
inductor's precompiled C++ headers on (torch's default) and off (what `--compile-cache` sets).

Run: PYTHONPATH=. python benchmarks/compile_cache.py [--layers 2]
Each case is a fresh process; "machines" are told apart by their TMPDIR (where torch keeps its
cache by default, and always its precompiled headers); the shared cache is a folder every one
of them names in TORCHINDUCTOR_CACHE_DIR, as `dlrover-run --compile-cache DIR` does.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from recovery_common import base_env, table

REPO = Path(__file__).resolve().parent.parent

STEP = """
import sys, time
sys.path.insert(0, {scripts!r})
import torch
from inprocess_train import SEQ, VOCAB, TinyTransformer
torch.manual_seed(0)
net = torch.compile(TinyTransformer({layers}))
started = time.time()
net(torch.randint(0, VOCAB, (4, SEQ))).sum().backward()
print(time.time() - started)
"""


def first_step(code: str, machine: Path, shared: Path, pch: bool) -> float:
    """Seconds of the first forward and backward in a fresh process on ``machine``."""
    machine.mkdir(exist_ok=True)
    env = base_env(
        TMPDIR=str(machine),
        TORCHINDUCTOR_CACHE_DIR=str(shared),
        TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS="1" if pch else "0",
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return float(done.stdout.split()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    a = p.parse_args()
    code = STEP.format(scripts=str(REPO / "tests" / "scripts"), layers=a.layers)
    cases = ("cold: nothing cached", "a fresh machine, the shared cache warm", "the same machine")
    columns = []
    with tempfile.TemporaryDirectory(prefix="dlrover-cc-") as tmp:
        for pch in (True, False):
            root = Path(tmp) / ("pch" if pch else "nopch")
            root.mkdir()
            shared = root / "shared"
            runs = [
                first_step(code, root / "a", shared, pch),
                first_step(code, root / "b", shared, pch),
                first_step(code, root / "b", shared, pch),
            ]
            print(f"  precompiled headers {'on' if pch else 'off'}: {runs}", flush=True)
            columns.append(runs)
    rows = [
        [case, f"{columns[0][i]:.1f} s", f"{columns[1][i]:.1f} s"] for i, case in enumerate(cases)
    ]
    head = ["first step", "precompiled headers on (torch's default)", "off (--compile-cache)"]
    print(
        f"\n### First step of a compiled {a.layers}-layer transformer (inductor), fresh processes\n"
    )
    print(table(head, rows))


if __name__ == "__main__":
    main()
