"""`benchmarks/restart_path.py`'s reading of its traces: the restart's window runs from the
kill to the restarted rank's first step; a process started in it counts whole, one that lived
through it only for what it did not do in as long a stretch before; test helpers never count."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _bench():  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(BENCHMARKS))  # it imports its sibling modules by name
    try:
        spec = importlib.util.spec_from_file_location(
            "restart_path", BENCHMARKS / "restart_path.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def _trace(directory: Path, pid: int, argv: str, *calls: tuple[float, str, str]) -> None:
    lines = [f"{calls[0][0] - 0.001:.6f} argv {argv}"]
    lines += [f"{at:.6f} {file} {fn}" for at, file, fn in calls]
    (directory / f"{pid}.trace").write_text("\n".join(lines) + "\n")


def test_the_window_counts_new_processes_whole_and_old_ones_for_what_is_new(
    tmp_path: Path,
) -> None:
    bench = _bench()
    _trace(
        tmp_path,
        10,
        "python -m dlrover.cli.master --port 0",
        (1.0, "dlrover/master/nodes.py", "add"),  # long before: out of every window
        (2.2, "dlrover/master/membership.py", "heartbeat"),
        (2.6, "dlrover/master/membership.py", "heartbeat"),  # background: not the restart's
        (2.7, "dlrover/master/rendezvous.py", "join"),
        (9.0, "dlrover/master/lifecycle.py", "succeed"),  # after the first step
    )
    _trace(
        tmp_path,
        11,
        "python -m dlrover.cli.run --nnodes=2 script.py",
        (2.3, "dlrover/agent/monitor.py", "wait"),
        (2.55, "dlrover/agent/monitor.py", "wait"),
        (2.65, "dlrover/agent/failures.py", "judge"),
    )
    _trace(
        tmp_path,
        12,
        "python -m dlrover.agent.zygote_server --fd 3",
        (2.0, "dlrover/trainer/progress.py", "report"),
        (2.5, "dlrover/testing/faults.py", "_fire"),
    )
    _trace(
        tmp_path,
        13,
        "python -m dlrover.agent.zygote_server --fd 3",
        (2.8, "dlrover/agent/bootstrap.py", "run_target"),
        (2.9, "dlrover/testing/digest.py", "tensors_digest"),
        (3.0, "dlrover/trainer/progress.py", "report"),
    )
    files, took = bench.restart_path(tmp_path)
    assert abs(took - 0.5) < 1e-6
    assert files == {
        "dlrover/master/rendezvous.py": {"master"},
        "dlrover/agent/failures.py": {"agent"},
        "dlrover/agent/bootstrap.py": {"worker"},
        "dlrover/trainer/progress.py": {"worker"},
    }
