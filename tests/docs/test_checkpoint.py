"""docs/checkpoint.md's first block (the flash-checkpoint API), assembled into the training
script it is a fragment of, run twice under dlrover-run: the second run resumes from the
first's checkpoint."""

from __future__ import annotations

import re
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.docs.blocks import doc_block, marker_id, user_dir, user_env

# What the fragment's `...` stands for: build the model and optimizer, restore them from
# `state`, then train; `m`, `o` and `step` are the names the fragment's save line uses. With
# lr 0.1 one step took the output (the checksum) to 0 up to rounding, so a run resumed from the
# checkpoint and a fresh one could print the same checksum; at 0.01 each step scales it by 0.9.
TRAINING = """\
import torch
from torch import nn

torch.manual_seed(0)
m = nn.Linear(4, 1)
o = torch.optim.SGD(m.parameters(), lr=0.01)
start = 0
if state:
    m.load_state_dict(state["model"])
    o.load_state_dict(state["optimizer"])
    start = state["step"]
    print("resumed at step", start, flush=True)
for step in range(start + 1, start + 4):
    loss = m(torch.ones(8, 4)).pow(2).mean()
    o.zero_grad()
    loss.backward()
    o.step()
"""
CHECKSUM = 'print("checksum", repr(sum(float(p.sum()) for p in m.parameters())), flush=True)\n'


def assemble(fragment: str, directory: Path) -> str:
    """The fragment with its `...` line replaced by TRAINING and the save statement (the lines
    between `...` and the wait) inside TRAINING's loop; its directory the test's own, and
    `StorageType.DISK`, which its comment offers (a MEMORY save ends with the job, so there
    would be nothing to resume a second job from)."""
    lines = fragment.splitlines(keepends=True)
    gap = next(i for i, line in enumerate(lines) if line.strip() == "...")
    wait = next(i for i, line in enumerate(lines) if line.startswith("ckpt.wait_latest"))
    save = "".join(lines[gap + 1 : wait]).replace("StorageType.MEMORY", "StorageType.DISK")
    head = "".join(lines[:gap]).replace('"/mnt/ckpt"', repr(str(directory)))
    assert repr(str(directory)) in head, "the fragment no longer names /mnt/ckpt"
    return head + TRAINING + textwrap.indent(save, "    ") + "".join(lines[wait:]) + CHECKSUM


@pytest.mark.e2e
def test_save_and_load_as_the_page_shows(tmp_path: Path) -> None:
    block = doc_block(marker_id(__file__, "test_save_and_load_as_the_page_shows"))
    where, env = user_dir(tmp_path), user_env(tmp_path)
    (where / "train.py").write_text(assemble(block.text, tmp_path / "ckpt"))
    outputs = []
    for _ in range(2):
        done = subprocess.run(
            ["dlrover-run", "--standalone", "--nproc-per-node=1", "train.py"], cwd=where,
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        outputs.append(done.stdout)
    assert "resumed at" not in outputs[0], outputs[0]
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "6"
    assert "resumed at step 3" in outputs[1], outputs[1]
    first = re.search(r"^checksum (\S+)$", outputs[0], re.MULTILINE)
    assert first, outputs[0]
    # The resumed run starts from the first run's model: a fresh model would give run 1's
    # checksum again; three more steps from the saved one give another.
    second = re.search(r"^checksum (\S+)$", outputs[1], re.MULTILINE)
    assert second and second[1] != first[1], outputs
