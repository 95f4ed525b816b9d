"""Any script that runs under torchrun sees the same environment keys under dlrover-run."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.conftest import SCRIPTS, MasterProcess, clean_env, dlrover_run, run_cmd

CONTRACT = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE",
    "OMP_NUM_THREADS",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
]
# Values that legitimately differ between two launches: ports, run ids, per-run paths, and
# whether the agent shares its store (torchrun: yes; dlrover: never, see worker_env.py).
DIFFERENT_BY_NATURE = {
    "MASTER_PORT",
    "MASTER_ADDR",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_USE_AGENT_STORE",
}


def _load(d: Path, n: int) -> list[dict[str, str]]:
    return [json.loads((d / f"env.{r}.json").read_text()) for r in range(n)]


def test_env_matches_torchrun(tmp_path: Path):
    flags = ["--nproc-per-node=2", "--max-restarts=2", "--role=trainer", "--log-dir"]
    t_dir, d_dir = tmp_path / "torchrun", tmp_path / "dlrover"
    t_dir.mkdir()
    d_dir.mkdir()
    t = subprocess.run(
        [
            *run_cmd("torch.distributed.run"),
            "--standalone",
            *flags,
            str(tmp_path / "tlogs"),
            str(SCRIPTS / "dump_env.py"),
            str(t_dir),
        ],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert t.returncode == 0, t.stderr
    d = dlrover_run(
        ["--standalone", *flags, str(tmp_path / "dlogs"), str(SCRIPTS / "dump_env.py"), str(d_dir)]
    )
    assert d.returncode == 0, d.stderr
    for te, de in zip(_load(t_dir, 2), _load(d_dir, 2), strict=True):
        missing = [k for k in CONTRACT if k in te and k not in de]
        assert missing == []
        same = {k: te[k] for k in CONTRACT if k in te and k not in DIFFERENT_BY_NATURE}
        assert {k: de[k] for k in same} == same
        assert de["MASTER_ADDR"] and int(de["MASTER_PORT"]) > 0
        assert de["TORCHELASTIC_ERROR_FILE"].endswith("error.json")
        assert f"rank_{de['RANK']}" in de["TORCHELASTIC_ERROR_FILE"]


def test_without_rdzv_id_the_job_is_named_by_its_master(tmp_path: Path, master: MasterProcess):
    """Never the bare "none": a node joining a master takes the name the master reports."""
    r = dlrover_run(
        ["--nnodes=1", "--nproc-per-node=1", str(SCRIPTS / "dump_env.py"), str(tmp_path)],
        env=clean_env(**master.vars),
    )
    assert r.returncode == 0, r.stderr
    env = json.loads((tmp_path / "env.0.json").read_text())
    assert env["TORCHELASTIC_RUN_ID"] == env["DLROVER_JOB_NAME"]
    assert env["TORCHELASTIC_RUN_ID"].startswith("job-")
    assert master.wait() == 0
    assert f"job {env['TORCHELASTIC_RUN_ID']} succeeded" in (tmp_path / "master.log").read_text()
