"""docs/streaming.md's Ray Data "Try it", run as written against a real local Ray cluster (CI's
extras stage installs ray[data])."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.docs.blocks import Shell, doc_block, marker_id, user_dir, user_env

pytestmark = [pytest.mark.extras, pytest.mark.xdist_group("ray")]  # one Ray cluster at a time
pytest.importorskip("ray.data", reason="RayDataSource needs `pip install 'ray[data]'`")


def test_ray_data_try_it(tmp_path: Path) -> None:
    """Substituted: the head's port 6380 becomes a free one and /tmp/ the test's directory.
    This machine's own settings go in the environment, not the text: Ray's session files in a
    short folder (its socket paths must stay under 108 bytes), Ray kept on loopback (the
    machine's address is not routable here), no token auth, no usage stats. Promised: the job
    prints step 200/200 and its checkpoint is at step 200."""
    block = doc_block(marker_id(__file__, "test_ray_data_try_it"))
    port = free_port()
    text = block.text.replace("6380", str(port)).replace("/tmp/", f"{tmp_path}/")
    ray_tmp = f"/tmp/dlrd-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    os.makedirs(ray_tmp)
    env = user_env(
        tmp_path,
        RAY_TMPDIR=ray_tmp,
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
    )
    shell = Shell(text, user_dir(tmp_path), env, tmp_path / "shell.log")
    try:
        code = shell.wait(timeout=300)
        out = shell.output()
        assert code == 0, out[-4000:]
        assert "step 200/200 loss" in out, out[-4000:]
        assert (tmp_path / "ray-ckpt" / "latest").read_text().strip() == "200"
    finally:
        shell.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)
