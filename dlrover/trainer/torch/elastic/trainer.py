"""ElasticTrainer: keeps the global batch size fixed as the number of workers changes.

Two ways to call it, one class:

- DLRover's: ``ElasticTrainer(model, dataloader=None)``, ``prepare(optimizer, lr_scheduler=None)``
  and ``with trainer.step(fix_total_batch_size=False):`` around a micro-batch whose body calls
  ``optimizer.step()`` and ``zero_grad()`` itself; the prepared optimizer and scheduler only act
  on the micro-batch that completes a global batch.
- Ours: ``ElasticTrainer(model, optimizer=..., global_batch_size=..., micro_batch_size=...)``
  with ``with trainer.micro_step(): trainer.backward(loss)``; the trainer steps the optimizer
  and scales the loss.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from dlrover.constants import ENV_MAX_NODES, ENV_WORKER_NUM
from dlrover.trainer.torch.elastic import placement
from dlrover.worker_context import WorkerContext

logger = logging.getLogger(__name__)


def accumulation_steps(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Micro-batches per rank per optimizer step so that micro x world x steps == global."""
    per_step = micro_batch_size * world_size
    if global_batch_size <= 0 or micro_batch_size <= 0 or world_size <= 0:
        raise ValueError(
            f"global batch {global_batch_size}, micro batch {micro_batch_size} and world size "
            f"{world_size} must all be positive"
        )
    if global_batch_size % per_step:
        raise ValueError(
            f"global batch size {global_batch_size} is not a multiple of micro batch "
            f"{micro_batch_size} x world size {world_size} = {per_step}; choose a global batch "
            f"divisible by micro batch x every world size the job may run with"
        )
    return global_batch_size // per_step


def max_world_accumulation(max_world: int, world_size: int) -> int:
    """Micro-batches per global batch so that the job trains as if it had ``max_world`` ranks:
    ``ceil(max_world / world_size)``, the same on every rank. (DLRover gives the first
    ``max_world % world_size`` ranks one more, which makes DDP ranks all-reduce different
    numbers of times and hang; here a world that does not divide rounds up for every rank.)"""
    if world_size <= 0 or max_world <= 0:
        return 1
    return max(1, -(-max_world // world_size))


@dataclass
class GradientState:
    """Where a trainer is inside a global batch; shared by the trainer and what it prepared."""

    sync_gradients: bool = True
    """True on the micro-batch whose backward all-reduces and whose optimizer step applies."""
    num_backward_steps: int = 0
    """Micro-batches run so far."""
    num_steps: int = 0
    """Optimizer steps applied (global batches) since the last ``reset()``."""
    in_step: bool = False
    """True inside ``ElasticTrainer.step()``; outside it the wrappers act on every call."""


class ElasticOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer so that ``step`` and ``zero_grad`` act only when the micro-batch
    completes a global batch; everything else (state, param_groups, state_dict) is the wrapped
    optimizer's, so checkpoints of either load into the other."""

    def __init__(self, optimizer: torch.optim.Optimizer, state: GradientState) -> None:
        # Deliberately no super().__init__: this object owns no parameters of its own.
        self.optimizer = optimizer
        self.gradient_state = state

    @property  # type: ignore[override]
    def state(self) -> Any:
        """The wrapped optimizer's per-parameter state."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property  # type: ignore[override]
    def param_groups(self) -> Any:
        """The wrapped optimizer's parameter groups (learning rates and the like)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def defaults(self) -> Any:
        """The wrapped optimizer's default hyper-parameters."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: Any) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer."""
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (loads into a plain optimizer too)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a (plain or wrapped) optimizer's state dict into the wrapped optimizer."""
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients, on the micro-batch that completes a global batch only."""
        if self.gradient_state.sync_gradients or not self.gradient_state.in_step:
            self.optimizer.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Apply the accumulated gradients, on the micro-batch that completes a global batch
        only (None on the others)."""
        if self.gradient_state.sync_gradients or not self.gradient_state.in_step:
            return self.optimizer.step(closure)
        return None

    def __repr__(self) -> str:
        return f"ElasticOptimizer({self.optimizer!r})"


class ElasticLRScheduler:
    """Wraps an LR scheduler so that it steps only with the optimizer (once per global batch)."""

    def __init__(self, scheduler: Any, state: GradientState) -> None:
        self.scheduler = scheduler
        self.gradient_state = state

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the wrapped scheduler: inside ``ElasticTrainer.step()`` on the micro-batch that
        completes a global batch only; outside it (once per epoch, say) always."""
        if self.gradient_state.sync_gradients or not self.gradient_state.in_step:
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        """The learning rates the wrapped scheduler set last."""
        return list(self.scheduler.get_last_lr())

    def get_lr(self) -> Any:
        """The wrapped scheduler's current learning rates."""
        return self.scheduler.get_lr()

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's state dict."""
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a scheduler state dict into the wrapped scheduler."""
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # Anything else (last_epoch, base_lrs, optimizer, ...) is the wrapped scheduler's.
        return getattr(self.__dict__["scheduler"], name)


class ElasticTrainer:
    """Gradient accumulation that keeps the global batch fixed when the world size changes.

    DLRover's API: ``prepare(optimizer, lr_scheduler=None)`` returns the optimizer (and the
    scheduler) wrapped so that they act once per global batch; ``with trainer.step(True):``
    around each micro-batch skips DDP's all-reduce (``no_sync``) and the optimizer step on
    all but the last micro-batch of a global batch. ``gradient_accumulation_steps`` is the
    largest world size the job may reach (``WORKER_NUM`` or dlrover-run's ``--nnodes`` maximum,
    times ``LOCAL_WORLD_SIZE``) over the current world size, rounded up alike on every rank;
    ``step(False)`` (the default) applies every micro-batch. As in DLRover, the loss is not
    scaled: divide it yourself.

    Our API: give ``optimizer``, ``global_batch_size`` and ``micro_batch_size``; then
    ``gradient_accumulation_steps = global / (micro x world)`` (an error if it does not
    divide), and ``with trainer.micro_step(): trainer.backward(loss)`` steps the optimizer and
    scales the loss by 1 / accumulation, so the update equals one over the whole global batch.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        dataloader: Any = None,
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        world_size: int | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        if isinstance(dataloader, torch.optim.Optimizer):
            # Our positional form: ElasticTrainer(model, optimizer, global, micro[, world]).
            optimizer, dataloader = dataloader, None
        self.model = model
        self.dataloader = dataloader
        self.gradient_state = GradientState()
        self.world_size = world_size or placement.world_size()
        self.optimizer = optimizer
        self.global_batch_size = global_batch_size or 0
        self.micro_batch_size = micro_batch_size or 0
        self.gradient_accumulation_steps = 1
        self.micro_steps = 0
        """Micro-batches since the last optimizer step (``micro_step`` API)."""
        self.optimizer_steps = 0
        """Optimizer steps applied through ``micro_step``."""
        if global_batch_size or micro_batch_size:
            if optimizer is None or not global_batch_size or not micro_batch_size:
                raise ValueError(
                    "ElasticTrainer with a global batch size needs optimizer=, "
                    "global_batch_size= and micro_batch_size= together; DLRover's form is "
                    "ElasticTrainer(model, dataloader=None) followed by prepare(optimizer)"
                )
            self.gradient_accumulation_steps = accumulation_steps(
                global_batch_size, micro_batch_size, self.world_size
            )
            logger.info(
                "global batch %d = micro %d x world %d x accumulation %d",
                global_batch_size,
                micro_batch_size,
                self.world_size,
                self.gradient_accumulation_steps,
            )

    # --- DLRover's API -----------------------------------------------------------------------
    def prepare(self, optimizer: torch.optim.Optimizer, lr_scheduler: Any = None) -> Any:
        """Wrap ``optimizer`` (and ``lr_scheduler``) so they step once per global batch; returns
        the optimizer, or ``(optimizer, lr_scheduler)`` when a scheduler is given."""
        ctx = WorkerContext.from_env()
        max_nodes = _int_env(ENV_WORKER_NUM) or _int_env(ENV_MAX_NODES) or 0
        max_world = max_nodes * ctx.local_world_size if max_nodes else self.world_size
        rank = placement.rank()
        self.gradient_accumulation_steps = max_world_accumulation(max_world, self.world_size)
        logger.info(
            "rank %d: world size %d of at most %d, %d micro-batches per global batch",
            rank,
            self.world_size,
            max_world,
            self.gradient_accumulation_steps,
        )
        wrapped = ElasticOptimizer(optimizer, self.gradient_state)
        self.optimizer = optimizer
        if lr_scheduler is not None:
            return wrapped, ElasticLRScheduler(lr_scheduler, self.gradient_state)
        return wrapped

    @contextlib.contextmanager
    def step(self, fix_total_batch_size: bool = False) -> Iterator[None]:
        """Wraps one micro-batch (forward, backward, ``optimizer.step()``, ``zero_grad()``).

        With ``fix_total_batch_size`` the gradients of ``gradient_accumulation_steps``
        micro-batches are accumulated (DDP's ``no_sync`` on all but the last) and the prepared
        optimizer applies them on the last; without it every micro-batch is applied."""
        state = self.gradient_state
        state.num_backward_steps += 1
        if fix_total_batch_size:
            state.sync_gradients = state.num_backward_steps % self.gradient_accumulation_steps == 0
        else:
            state.sync_gradients = True
        sync: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        no_sync = getattr(self.model, "no_sync", None)
        if not state.sync_gradients and callable(no_sync):
            sync = no_sync()
        state.in_step = True
        try:
            with sync:
                yield
        except BaseException:
            # The micro-batch failed (a peer's failure cut its all-reduce): its partial
            # gradients must not leak into the step that is run again. The global batch it was
            # part of starts over: its gradients so far go, and so does its count.
            per_batch = self.gradient_accumulation_steps if fix_total_batch_size else 1
            state.num_backward_steps = (state.num_backward_steps - 1) // per_batch * per_batch
            self._drop_gradients()
            raise
        finally:
            state.in_step = False
        if state.sync_gradients:
            state.num_steps += 1
        update = getattr(self.dataloader, "update_batch_size", None)
        if callable(update):
            update()

    def _drop_gradients(self) -> None:
        """Clear the gradients of the model's parameters (after a failed micro-batch: those of
        the micro-batches before it in the same global batch go too, as the whole global batch
        is run again from its checkpoint)."""
        for param in self.model.parameters():
            param.grad = None

    def reset(self) -> None:
        """Start counting ``num_steps`` from 0 again (DLRover calls it at each epoch)."""
        self.gradient_state.num_steps = 0

    @property
    def num_steps(self) -> int:
        """Global batches applied since the last ``reset()``."""
        return self.gradient_state.num_steps

    # --- our API -----------------------------------------------------------------------------
    def reset_world(self, world_size: int) -> None:
        """Recompute accumulation for a new world size; only between optimizer steps."""
        if self.micro_steps:
            raise RuntimeError(
                f"world size changed after {self.micro_steps} micro-batches of a global batch; "
                f"change it only between optimizer steps"
            )
        self.gradient_accumulation_steps = accumulation_steps(
            self.global_batch_size, self.micro_batch_size, world_size
        )
        self.world_size = world_size

    @property
    def is_last_micro_step(self) -> bool:
        """True when the next micro-batch completes the global batch (its ``micro_step`` steps the
        optimizer)."""
        return self.micro_steps + 1 >= self.gradient_accumulation_steps

    @contextlib.contextmanager
    def micro_step(self) -> Iterator[bool]:
        """Wraps forward + backward of one micro-batch; yields True on the optimizer step."""
        if self.optimizer is None:
            raise RuntimeError(
                "micro_step() steps the optimizer: construct ElasticTrainer with optimizer=, "
                "global_batch_size= and micro_batch_size=, or use prepare() and step()"
            )
        last = self.is_last_micro_step
        sync: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if isinstance(self.model, DistributedDataParallel) and not last:
            sync = self.model.no_sync()
        try:
            with sync:
                yield last
        except BaseException:
            # As in step(): the global batch is run again, without this one's gradients.
            self.micro_steps = 0
            self._drop_gradients()
            raise
        self.micro_steps += 1
        if last:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.micro_steps = 0
            self.optimizer_steps += 1
            self.gradient_state.num_steps += 1

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` scaled by 1 / ``gradient_accumulation_steps``."""
        (loss / self.gradient_accumulation_steps).backward()


def _int_env(name: str) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value else 0
    except ValueError:
        logger.warning("ignoring %s=%r: not an integer", name, value)
        return 0
