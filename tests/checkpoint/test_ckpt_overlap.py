"""Overlapped saves: the copy runs in the background, optimizer.step waits for it."""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import pytest
import torch

from dlrover.checkpoint.config import ENV_CHECKPOINT_SOCKET
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType
from tests.checkpoint.harness import assert_same


def test_optimizer_step_waits_for_the_overlapped_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_CHECKPOINT_SOCKET, raising=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.randn(4, 256)).sum().backward()
    before = copy.deepcopy(model.state_dict())
    about_to_step = threading.Event()

    def gate(i: int) -> None:
        if i == 0:  # hold the copy until the trainer has moved on to optimizer.step
            assert about_to_step.wait(10)

    ckpt = DdpCheckpointer(str(tmp_path / "ckpt"))
    try:
        assert ckpt.engine.save_overlapped(
            1, {"model": model.state_dict()}, persist=True, after_tensor=gate
        )
        about_to_step.set()
        optim.step()  # the pre-step hook blocks until the copy is complete
        assert not torch.equal(model.state_dict()["0.weight"], before["0.weight"])
        assert ckpt.wait_latest_checkpoint(30)
        state = ckpt.load_checkpoint()
        assert_same({"model": before}, state)
        # The plain API path: overlap=True, then another step, then a blocking save.
        assert ckpt.save_checkpoint(
            2, {"model": model.state_dict()}, storage_type=StorageType.MEMORY, overlap=True
        )
        ckpt.wait_copy()
    finally:
        ckpt.close()
