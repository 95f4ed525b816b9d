"""What a training script imports: progress reporting, checkpointers, elastic data loading."""

from dlrover.trainer.progress import StepReporter, report_step, section

__all__ = ["StepReporter", "report_step", "section"]
