"""FlashCkptTrainer: a real transformers.Trainer saves through flash checkpoint and resumes."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from dlrover.checkpoint.config import ENV_CHECKPOINT_SOCKET
from tests.checkpoint.harness import assert_same, running_saver

pytestmark = pytest.mark.extras
# As FlashCkptTrainer does: transformers' PyTorch side only (read when it is first imported), since
# the extras stage installs TensorFlow too.
os.environ.setdefault("USE_TF", "0")
transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install transformers==4.57.1)"
)
pytest.importorskip(  # Trainer needs it at run time
    "accelerate", reason="accelerate is not installed (pip install accelerate==1.11.0)"
)

from dlrover.trainer.torch.flash_checkpoint.hf_trainer import FlashCkptTrainer  # noqa: E402

MAX_STEPS, SAVE_STEPS = 6, 3


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Fixed random token sequences (a language-modelling task with labels = inputs)."""

    def __init__(self, n: int = 40, length: int = 12) -> None:
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, 64, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(tmp: Path, seed: int) -> FlashCkptTrainer:
    torch.manual_seed(seed)  # a fresh model differs from the saved one until it is loaded
    config = transformers.GPT2Config(
        vocab_size=64,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=str(tmp / "out"),
        max_steps=MAX_STEPS,
        save_steps=SAVE_STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    return FlashCkptTrainer(
        model=model, args=args, train_dataset=_Tokens(), flash_checkpoint_dir=str(tmp / "ckpt")
    )


class _AtTrainBegin(transformers.TrainerCallback):  # type: ignore[misc]
    """Snapshots the trainer once resumed, before any step runs (Trainer runs one more step
    even when resuming at max_steps)."""

    def __init__(self, trainer: FlashCkptTrainer) -> None:
        self.trainer = trainer
        self.state: dict[str, Any] = {}

    def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
        self.state = _snapshot(self.trainer)


def _resumed_state(trainer: FlashCkptTrainer, resume: str | bool) -> dict[str, Any]:
    probe = _AtTrainBegin(trainer)
    trainer.add_callback(probe)
    trainer.train(resume_from_checkpoint=resume)
    return probe.state


def _snapshot(trainer: FlashCkptTrainer) -> dict[str, Any]:
    assert trainer.optimizer is not None and trainer.lr_scheduler is not None
    return copy.deepcopy(
        {
            "model": trainer.model.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "lr_scheduler": trainer.lr_scheduler.state_dict(),
            "step": trainer.state.global_step,
        }
    )


def test_trainer_saves_and_resumes_bit_for_bit_from_memory_and_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with running_saver(tmp_path) as saver:  # the agent: memory outlives the trainers
        monkeypatch.setenv(ENV_CHECKPOINT_SOCKET, saver.socket_path)
        first = _trainer(tmp_path, seed=1)
        first.train()
        saved = _snapshot(first)  # the last save is at MAX_STEPS, after the last update
        assert saved["step"] == MAX_STEPS
        assert first.wait_latest_checkpoint(60)
        first.close()
        assert not list((tmp_path / "out").glob("checkpoint-*"))  # no Trainer disk save
        assert (tmp_path / "ckpt" / "latest").read_text() == str(MAX_STEPS)

        from_memory = _trainer(tmp_path, seed=2)
        loaded = _resumed_state(from_memory, True)
        assert from_memory.flash_checkpointer.last_load_source == "memory"
        assert_same(saved, loaded)
        from_memory.close()
    monkeypatch.delenv(ENV_CHECKPOINT_SOCKET)

    from_storage = _trainer(tmp_path, seed=3)  # no agent: memory is gone, storage remains
    # The resumed trainers above ran (and saved) one more step: ask for the one compared.
    loaded = _resumed_state(from_storage, str(tmp_path / "ckpt" / f"step_{MAX_STEPS}"))
    assert from_storage.flash_checkpointer.last_load_source == "storage"
    assert_same(saved, loaded)
    from_storage.close()


def test_resume_mid_run_trains_to_the_same_model(tmp_path: Path) -> None:
    whole = _trainer(tmp_path, seed=1)  # no agent: an in-process saver persists
    whole.train()
    expected = _snapshot(whole)
    assert whole.wait_latest_checkpoint(60)
    whole.close()
    resumed = _trainer(tmp_path, seed=4)
    # From the middle: data position, LR schedule, optimizer and RNG must all carry over.
    resumed.train(resume_from_checkpoint=str(tmp_path / "ckpt" / f"step_{SAVE_STEPS}"))
    assert_same(expected, _snapshot(resumed))
    resumed.close()
