"""A DeepSpeed script written as DLRover's nanoGPT ``ds_train.py`` and DeepSpeed's getting-started
tutorial name their checkpoints (``tag=steps``, ``tag=loss.item()``) runs unchanged under
dlrover-run: killed after a memory save, it resumes from memory and ends with the failure-free
run's model; the steps on storage are DeepSpeed's own (``<tag>/``, ``latest`` holding the tag),
read back by DeepSpeed's loader and by tag."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, clean_env
from tests.e2e.test_dlrover_examples import STYLE, assert_same_model, events, finish

pytest.importorskip(
    "deepspeed", reason="deepspeed is not installed (DS_BUILD_OPS=0 pip install deepspeed==0.19.8)"
)
pytestmark = [pytest.mark.extras, pytest.mark.timeout(600)]

MAX_ITERS, DISK_EVERY, KILL_AT = 12, 4, 6


def _launch(tmp: Path, name: str, *args: str) -> tuple[subprocess.Popen[bytes], Path, Path, Path]:
    out, ckpt, log = tmp / f"{name}-out", tmp / f"{name}-ckpt", tmp / f"{name}.log"
    out.mkdir()
    command = [sys.executable, "-m", "dlrover.cli.run", "--standalone", "--nproc_per_node=2",
               "--max-restarts=2", str(STYLE / "ds_train.py"), "--save_dir", str(ckpt),
               "--out", str(out), "--max_iters", str(MAX_ITERS),
               "--save_storage_interval", str(DISK_EVERY), *args]  # fmt: skip
    proc = subprocess.Popen(
        command, env=clean_env(DS_ACCELERATOR="cpu"), cwd=REPO, stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    return proc, out, ckpt, log


def test_deepspeed_tags_resume_from_memory_and_read_back_as_deepspeeds(tmp_path: Path) -> None:
    jobs = {
        "reference": _launch(tmp_path, "reference"),
        "step": _launch(tmp_path, "step", "--kill_at", str(KILL_AT)),
        "loss": _launch(tmp_path, "loss", "--tag", "loss", "--kill_at", str(KILL_AT)),
    }
    for proc, _, _, log in jobs.values():
        finish(proc, log)
    reference = jobs["reference"][1]
    for name in ("step", "loss"):
        _, out, ckpt, _ = jobs[name]
        assert_same_model(out, reference)
        for rank in (0, 1):
            starts = [e for e in events(out, rank) if e["event"] == "start"]
            assert [(s["restart"], s["step"], s["source"]) for s in starts] == [
                (0, 0, None),
                (1, KILL_AT, "memory"),
            ], (name, rank, starts)
        trained = next(e for e in events(out, 0) if e["event"] == "trained")
        tags: dict[str, str] = trained["tags"]
        if name == "step":
            assert tags == {str(s): str(s) for s in range(8, MAX_ITERS + 1, DISK_EVERY)}
        # DeepSpeed's layout: the newest step's directory is its tag, `latest` holds the tag.
        newest = tags[str(MAX_ITERS)]
        assert (ckpt / "latest").read_text() == newest
        assert (ckpt / newest / "mp_rank_00_model_states.pt").is_file()
        optim = sorted(p.name for p in (ckpt / newest).glob("*optim_states.pt"))
        assert len(optim) == 2, optim
        for rank in (0, 1):
            own = next(e for e in events(out, rank) if e["event"] == "deepspeed_load")
            assert own["same"] and own["steps"] == MAX_ITERS, own
        if name == "step":
            by_tag = next(e for e in events(out, 0) if e["event"] == "tag_load")
            assert by_tag["steps"] == by_tag["wanted"] == MAX_ITERS - DISK_EVERY, by_tag
            assert by_tag["path"] == str(ckpt / str(MAX_ITERS - DISK_EVERY))
