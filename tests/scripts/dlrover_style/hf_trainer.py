"""A Hugging Face Trainer script written the way DLRover's flash-checkpoint blog shows it: replace
``Trainer`` with ``FlashCkptTrainer`` and resume with ``trainer.get_last_checkpoint()``."""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("USE_TF", "0")

import torch  # noqa: E402
import transformers  # noqa: E402
from common import record, save_final  # noqa: E402  (this folder is on sys.path)

from dlrover.trainer.torch.flash_checkpoint.hf_trainer import FlashCkptTrainer  # noqa: E402


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int = 64, length: int = 12) -> None:
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, 64, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Progress(transformers.TrainerCallback):  # type: ignore[misc]
    """Records the steps a save was due at (FlashCkptTrainer saved them as the step ended) and
    the epochs trained."""

    def __init__(self, out: str, trainer: FlashCkptTrainer) -> None:
        self.out = out
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        source = self.trainer.flash_checkpointer.last_load_source
        record(self.out, "train_begin", step=state.global_step, source=source)

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step % args.save_steps == 0:
            record(self.out, "saved", step=state.global_step, returned=True)

    def on_epoch_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        record(self.out, "epoch", epoch=round(state.epoch or 0) - 1, step=state.global_step)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--output_dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--save_steps", type=int, default=3)
    a = p.parse_args()
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    training_arguments = transformers.TrainingArguments(
        output_dir=a.output_dir,
        num_train_epochs=a.epochs,
        save_steps=a.save_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=2,
        logging_steps=5,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        ddp_backend="gloo",
    )
    trainer = FlashCkptTrainer(model=model, train_dataset=Tokens(), args=training_arguments)
    trainer.add_callback(Progress(a.out, trainer))
    # Get the latest checkpoint path.
    last_ckpt_path = trainer.get_last_checkpoint()
    record(a.out, "start", step=0, last_checkpoint=str(last_ckpt_path))
    trainer.train(resume_from_checkpoint=last_ckpt_path)
    record(
        a.out, "resumed", step=trainer.state.global_step,
        source=trainer.flash_checkpointer.last_load_source,
    )  # fmt: skip
    save_final(a.out, trainer.model.state_dict())


if __name__ == "__main__":
    main()
