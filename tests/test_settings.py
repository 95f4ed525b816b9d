"""Settings from the environment: every variable is named in dlrover/constants.py, and each
subsystem reads its own in one place (checkpoint, sharding)."""

from __future__ import annotations

import ast
import tempfile
from pathlib import Path

import pytest

from dlrover.checkpoint.config import CheckpointEnv
from dlrover.sharding.config import DEFAULT_LEASE_S, DEFAULT_PREFETCH_SHARDS, ShardingEnv

PACKAGE = Path(__file__).resolve().parent.parent / "dlrover"


def test_every_environment_variable_name_is_defined_in_constants():
    """Modules import ENV_* names from dlrover.constants (re-exporting them is fine); none
    defines its own."""
    own = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "constants.py" and path.parent == PACKAGE:
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                own += [f"{path.relative_to(PACKAGE)}: {n}" for n in names if n.startswith("ENV_")]
    assert own == []


def test_the_checkpoint_settings_are_read_together_and_name_a_bad_variable(tmp_path: Path):
    tmp = tempfile.gettempdir()
    assert CheckpointEnv.from_env({}) == CheckpointEnv(1024 * 2**20, 2, "/dev/shm", tmp)
    env = {
        "DLROVER_CKPT_REPLICA_MIB_S": "0",
        "DLROVER_CKPT_BUFFERS": "1",
        "DLROVER_CKPT_SHM_DIR": str(tmp_path),
        "DLROVER_CKPT_SPILL_DIR": "off",
    }
    assert CheckpointEnv.from_env(env) == CheckpointEnv(None, 1, str(tmp_path), None)
    with pytest.raises(ValueError, match="DLROVER_CKPT_BUFFERS='3': give 1 or 2"):
        CheckpointEnv.from_env({"DLROVER_CKPT_BUFFERS": "3"})
    for name in ("DLROVER_CKPT_SHM_DIR", "DLROVER_CKPT_SPILL_DIR"):
        with pytest.raises(ValueError, match=f"{name}='/nowhere': no such folder"):
            CheckpointEnv.from_env({name: "/nowhere"})


def test_the_sharding_settings_are_read_together():
    assert ShardingEnv.from_env({}) == ShardingEnv(DEFAULT_PREFETCH_SHARDS, DEFAULT_LEASE_S)
    env = {"DLROVER_SHARD_PREFETCH": "5", "DLROVER_SHARD_LEASE_S": "1.5"}
    assert ShardingEnv.from_env(env) == ShardingEnv(5, 1.5)
    with pytest.raises(ValueError):
        ShardingEnv.from_env({"DLROVER_SHARD_PREFETCH": "many"})


def test_script_arguments_that_abbreviate_a_flag_stay_the_script_s() -> None:
    """torchrun's rule: everything after the script is the script's, even ``--max 3`` (a
    prefix of --max-restarts and --max_restarts) or ``--compile x`` (of --compile-cache)."""
    from dlrover.cli.job import build_parser as job_parser
    from dlrover.cli.run import build_parser as run_parser

    args = run_parser().parse_args(["--standalone", "train.py", "--max", "3", "--compile", "x"])
    assert args.training_script_args == ["--max", "3", "--compile", "x"]
    assert args.max_restarts == 0 and args.compile_cache == ""
    job = job_parser().parse_args(["submit", "train.py", "--max", "3", "--compile", "x"])
    assert job.args == ["--max", "3", "--compile", "x"] and job.compile_cache is None
