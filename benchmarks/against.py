"""Another commit of this repository beside this one, for a benchmark's `--against REV` rows.

`checkout(rev)` adds a detached git worktree of REV in a temporary directory (removed after);
a process started with ``cwd`` and ``PYTHONPATH`` set to it runs that commit's DLRover, so one
benchmark run measures the code before a change and after it side by side, under the same load.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """The tree of ``rev`` (a commit, tag or branch of this repository) while the block runs."""
    tmp = Path(tempfile.mkdtemp(prefix="dlrover-against-"))
    tree = tmp / "tree"
    added = subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree), rev],
        capture_output=True,
        text=True,
    )
    if added.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(
            f"--against {rev}: cannot check it out beside this tree ({added.stderr.strip()}); "
            "give a commit of this git repository"
        )
    try:
        yield tree
    finally:
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
            capture_output=True,
        )
        shutil.rmtree(tmp, ignore_errors=True)
