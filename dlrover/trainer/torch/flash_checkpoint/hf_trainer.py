"""FlashCkptTrainer: a transformers.Trainer whose checkpoints go through flash checkpoint."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import tempfile
from typing import Any

import numpy as np
import torch

# This trainer is PyTorch's: keep transformers off its TensorFlow side, which it loads when
# TensorFlow is installed too (dlrover[tensorflow]) and which needs tf-keras under Keras 3.
# An explicit USE_TF from the user wins.
os.environ.setdefault("USE_TF", "0")

from transformers import (
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import SaveStrategy

from dlrover.checkpoint.errors import CheckpointError
from dlrover.hang_spec import EVAL
from dlrover.trainer.progress import section
from dlrover.trainer.torch.flash_checkpoint.checkpointer import storage_step
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

__all__ = ["FlashCkptTrainer", "StorageType"]

log = logging.getLogger(__name__)

_TRAINER_STATE_FILE = "trainer_state.json"  # the name Trainer reads on resume


class _FlashSaveCallback(TrainerCallback):
    """Takes over each save the Trainer's flow decides on: the state goes to flash checkpoint
    and the Trainer's own (disk) save is cancelled by clearing ``should_save``."""

    def __init__(self, trainer: FlashCkptTrainer) -> None:
        self._trainer = trainer

    def _save_if_asked(self, control: TrainerControl) -> TrainerControl:
        if control.should_save:
            self._trainer.flash_save()
            control.should_save = False
        return control

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        return self._save_if_asked(control)

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        return self._save_if_asked(control)


class FlashCkptTrainer(Trainer):
    """A ``transformers.Trainer`` whose checkpoints are flash checkpoints.

    Each save the Trainer schedules (``save_steps`` or ``save_strategy="epoch"``) copies the
    model, optimizer, LR scheduler, RNG and ``TrainerState`` into the agent's shared memory
    (a memcpy) and, with ``storage_type=DISK``, persists them to ``flash_checkpoint_dir`` in
    the background. ``train(resume_from_checkpoint=True)`` resumes from the newest step, from
    memory after a process restart, else from storage (a ``step_<n>`` path picks one step);
    with nothing saved yet it trains from the start. Not supported: ``save_strategy="best"``
    and ``load_best_model_at_end`` (they need Trainer's checkpoint folders).
    """

    def __init__(
        self,
        *args: Any,
        flash_checkpoint_dir: str | None = None,
        storage_type: StorageType = StorageType.DISK,
        keep_last: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if keep_last is None:  # Trainer's own limit on checkpoints kept, else 3
            keep_last = self.args.save_total_limit or 3
        if self.args.save_strategy == SaveStrategy.BEST or self.args.load_best_model_at_end:
            raise CheckpointError(
                "FlashCkptTrainer does not support save_strategy='best' or "
                "load_best_model_at_end; use save_strategy='steps' or 'epoch'"
            )
        self.flash_checkpoint_dir = flash_checkpoint_dir or os.path.join(
            self.args.output_dir or ".", "flash_checkpoint"
        )
        self.storage_type = storage_type
        self.flash_checkpointer = DdpCheckpointer(self.flash_checkpoint_dir, keep_last=keep_last)
        self._resumed: dict[str, Any] | None = None
        self.add_callback(_FlashSaveCallback(self))

    # ------------------------------------------------------------------ saving
    def flash_state(self) -> dict[str, Any]:
        """What a save stores (tensors of the live model and optimizer, no copies)."""
        self.store_flos()
        # Trainer keeps the state of stateful callbacks (early stopping...) in TrainerState.
        # (TrainerState annotates the field as a list; it is a dict once the state exists.)
        stateful: dict[str, Any] = self.state.stateful_callbacks  # type: ignore[assignment]
        for cb in [*self.callback_handler.callbacks, self.control]:
            if isinstance(cb, ExportableState):
                name = cb.__class__.__name__
                if isinstance(stateful.get(name), list):
                    stateful[name].append(cb.state())
                else:
                    stateful[name] = cb.state()
        if self.model is None:
            raise CheckpointError("FlashCkptTrainer has no model to save")
        state: dict[str, Any] = {
            "model": self.model.state_dict(),
            "trainer_state": json.dumps(dataclasses.asdict(self.state), sort_keys=True),
            "step": self.state.global_step,
        }
        if not self.args.save_only_model:
            if self.optimizer is not None:
                state["optimizer"] = self.optimizer.state_dict()
            if self.lr_scheduler is not None:
                state["lr_scheduler"] = self.lr_scheduler.state_dict()
            state["rng"] = _rng_state()
        return state

    def flash_save(self) -> bool:
        """Save the current training state as step ``state.global_step`` now; True (a save that
        cannot happen raises CheckpointError naming the cause)."""
        return self.flash_checkpointer.save_checkpoint(
            self.state.global_step, self.flash_state(), storage_type=self.storage_type
        )

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """HF Trainer's evaluation, marked as the ``eval`` phase for hang detection (a long
        evaluation is judged against its own learned timeout, not the step's)."""
        with section(EVAL):
            result: dict[str, float] = super().evaluate(*args, **kwargs)
        return result

    def wait_latest_checkpoint(self, timeout: float = 1800.0) -> bool:
        """Block until the newest DISK save is committed on storage (False at the deadline)."""
        return self.flash_checkpointer.wait_latest_checkpoint(timeout)

    def close(self) -> None:
        """Release the flash checkpointer (its in-process saver, if there is no agent)."""
        self.flash_checkpointer.close()

    # ------------------------------------------------------------------ resuming
    def get_last_checkpoint(self) -> str | bool:
        """What to pass to ``train(resume_from_checkpoint=...)``, as with DLRover: the flash
        checkpoint directory when this node's shared memory or storage holds a step (the resume
        then takes the newest step every rank holds, memory first), False when nothing was
        saved yet (``train(resume_from_checkpoint=False)`` starts from scratch)."""
        try:
            held = self.flash_checkpointer.newest_step_held()
        except CheckpointError as exc:  # the agent's saver did not answer: storage alone
            log.warning("cannot ask the agent what its memory holds (%s)", exc)
            held = storage_step(self.flash_checkpointer.engine.catalog())
        return False if held is None else self.flash_checkpoint_dir

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``resume_from_checkpoint``: True or this trainer's flash checkpoint directory (what
        ``get_last_checkpoint()`` returns: the newest step, from memory after a restart), another
        flash checkpoint directory or a ``step_<n>`` directory (storage), or None/False (no
        resume)."""
        if not resume_from_checkpoint:
            return super().train(None, trial, ignore_keys_for_eval, **kwargs)
        path = "" if resume_from_checkpoint is True else str(resume_from_checkpoint)
        if path and os.path.abspath(path) == os.path.abspath(self.flash_checkpoint_dir):
            path = ""  # the directory itself: its newest step, from memory when it is there
        loaded = self.flash_checkpointer.load_checkpoint(path)
        if not loaded:
            log.info(
                "no flash checkpoint in %s: training from the start",
                path or self.flash_checkpoint_dir,
            )
            return super().train(None, trial, ignore_keys_for_eval, **kwargs)
        log.info(
            "resuming from flash checkpoint step %d (%s)",
            loaded["step"],
            self.flash_checkpointer.last_load_source,
        )
        self._resumed = loaded
        # Trainer restores the data position (epochs and batches to skip) only from a resume
        # directory's trainer_state.json; that file is all this directory holds, the rest
        # comes from the flash checkpoint through the loaders below.
        with tempfile.TemporaryDirectory(prefix="flash-resume-") as resume_dir:
            with open(os.path.join(resume_dir, _TRAINER_STATE_FILE), "w") as f:
                f.write(loaded["trainer_state"])
            try:
                return super().train(resume_dir, trial, ignore_keys_for_eval, **kwargs)
            finally:
                self._resumed = None

    # The three loaders below are Trainer internals: Trainer calls them with the resume
    # directory and has no public hook to restore a model or optimizer from anywhere else.
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._resumed is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        target = model if model is not None else self.model
        if target is None:
            raise CheckpointError("FlashCkptTrainer has no model to resume into")
        target.load_state_dict(self._resumed["model"])

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._resumed is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        if "optimizer" in self._resumed and self.optimizer is not None:
            self.optimizer.load_state_dict(self._resumed["optimizer"])
        if "lr_scheduler" in self._resumed and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(self._resumed["lr_scheduler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if self._resumed is None:
            super()._load_rng_state(checkpoint)
            return
        if "rng" in self._resumed:
            _set_rng_state(self._resumed["rng"])


def _rng_state() -> dict[str, Any]:
    """This process's RNG states, in types a flash checkpoint stores (no pickling)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
    return {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
    }


def _set_rng_state(rng: dict[str, Any]) -> None:
    version, keys, gauss = rng["python"]
    random.setstate((version, tuple(keys), gauss))
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(rng["torch"])
