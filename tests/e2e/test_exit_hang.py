"""The safety net for a rank that does not exit: its stacks are logged, it is ended and counted as
what its script returned, and the job ends with that result."""

from __future__ import annotations

import pytest

from tests.conftest import SCRIPTS, dlrover_run


def _run(mode: str) -> tuple[int, str]:
    r = dlrover_run(
        [
            "--standalone",
            "--nproc_per_node=2",
            "--max-restarts=0",
            "--monitor-interval=0.1",
            "--exit-hang-timeout=2",
            str(SCRIPTS / "exit_hang.py"),
            mode,
        ],
        timeout=120,
    )
    return r.returncode, r.stdout + r.stderr


@pytest.mark.e2e
def test_a_rank_stuck_after_its_script_returned_counts_as_succeeded() -> None:
    code, log = _run("after_return")
    assert "rank(s) 1 did not exit 2s after" in log, log
    assert "blocks_interpreter_exit" in log  # its stacks are in the log
    assert "after its script returned 0; counted as succeeded" in log
    assert code == 0, log


@pytest.mark.e2e
def test_a_rank_whose_script_never_returned_counts_as_failed() -> None:
    code, log = _run("in_script")
    assert "rank(s) 1 did not exit 2s after" in log, log
    assert "never_returns" in log
    assert code != 0, log
