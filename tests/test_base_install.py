"""A base install (`pip install dlrover`: no numpy, no torch) runs the master-side commands.

numpy comes with the `torch` and `ps` extras; `dlrover`, `dlrover-master` and a job without
embedding servers must not need it (a module that imports the embedding client at the top made
every `dlrover` subcommand fail with ModuleNotFoundError on a base install)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, clean_env

BLOCK = (
    "import sys\n"
    "class _Block:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in ('numpy', 'torch'):\n"
    "            raise ModuleNotFoundError(f'No module named {name!r} (blocked: a base install)')\n"
    "sys.meta_path.insert(0, _Block())\n"
)


@pytest.mark.parametrize(
    "module",
    ["dlrover.cli.job", "dlrover.cli.master", "dlrover.runner.job_runner", "dlrover.master.server"],
)
def test_the_master_side_imports_without_numpy_or_torch(module: str) -> None:
    code = BLOCK + f"import importlib\nimportlib.import_module({module!r})\n"
    r = subprocess.run(
        [sys.executable, "-c", code], env=clean_env(), cwd=REPO, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr[-2000:]
