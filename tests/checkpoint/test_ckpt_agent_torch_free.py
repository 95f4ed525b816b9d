"""The agent-side saver never imports torch, even while it persists and answers load votes."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

from tests.checkpoint.harness import REPO, kill, run_workers, worker_env


def test_import_and_start_do_not_load_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from dlrover.checkpoint.saver import CheckpointSaver\n"
        "s = CheckpointSaver(sys.argv[1], shm_prefix=sys.argv[2])\n"
        "s.start(); s.held_steps(); s.close(unlink=True)\n"
        "assert 'torch' not in sys.modules, 'the saver imported torch'\n"
        "print('torch-free')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "s.sock"), f"dlrtest-{uuid.uuid4().hex[:8]}"],
        cwd=REPO,
        env=worker_env(None),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.strip() == "torch-free", out.stderr


def test_agent_process_persists_and_serves_loads_without_torch(tmp_path: Path) -> None:
    ckpt, sock = str(tmp_path / "ckpt"), str(tmp_path / "agent.sock")
    prefix = f"dlrtest-{uuid.uuid4().hex[:8]}"
    agent = subprocess.Popen(
        [sys.executable, "-m", "tests.checkpoint.saver_proc", sock, prefix, "-1", "unused"],
        cwd=REPO,
        env=worker_env(None),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert agent.stdout is not None and agent.stdout.readline().strip() == b"ready"
        # A worker (with torch) saves; the agent streams the plain part to storage.
        run_workers(["ddp_save", ckpt, "1", "disk"], [worker_env(sock)])
        # A restarted worker loads from the agent's memory after the agent's load vote.
        run_workers(["ddp_load", ckpt, "1", "memory"], [worker_env(sock, restart=1)])
        out, _ = agent.communicate(b"", timeout=60)
    except BaseException:
        kill(agent)
        raise
    assert agent.returncode == 0
    report = json.loads(out.decode().strip().splitlines()[-1])
    assert report == {"torch_loaded": False, "held": {"0": 1}}
    assert (tmp_path / "ckpt" / "latest").read_text() == "1"
    manifest = json.loads((tmp_path / "ckpt" / "step_1" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"rank_0.bin", "rank_0.meta.json"}
    with subprocess.Popen(  # and what it wrote loads from storage, bit for bit
        [sys.executable, "-m", "tests.checkpoint.workers", "ddp_load", ckpt, "1", "storage"],
        cwd=REPO,
        env=worker_env(None),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    ) as loader:
        text, _ = loader.communicate(timeout=60)
    assert loader.returncode == 0, text.decode()
