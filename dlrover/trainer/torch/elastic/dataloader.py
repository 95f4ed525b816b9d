"""ElasticDataLoader: a DataLoader whose batch size can change while training, and which tells a
DynamicShardSampler which samples were trained."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from dlrover.constants import ENV_PARALLELISM_CONFIG
from dlrover.trainer.torch.elastic.dynamic_sampler import DynamicShardSampler

logger = logging.getLogger(__name__)


class ElasticDataLoader(DataLoader):  # type: ignore[type-arg]
    """``torch.utils.data.DataLoader`` (same arguments) plus DLRover's run-time batch size.

    ``update_batch_size(n)`` changes the batch size from the next batch on;
    ``update_batch_size()`` without an argument reads it from ``config_file`` (or the file named
    by DLROVER_PARAL_CONFIG_PATH) when that file's ``dataloader.version`` is newer;
    ``ElasticTrainer.step()`` calls it after each step. ``get_batch_size()`` tells the current one.

    Over a ``DynamicShardSampler`` batch k counts as trained when batch k+1 is asked for (or the
    loop ends), and the sampler is told so: shards are reported done exactly when their samples
    are trained, whatever the DataLoader prefetches. ``state_dict()`` / ``load_state_dict()``
    then checkpoint the sampler's place after the batches trained so far in this iteration.
    """

    def __init__(self, *args: Any, config_file: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.config_file = config_file or os.environ.get(ENV_PARALLELISM_CONFIG, "")
        self._config_version = 0
        self.steps_in_epoch = 0
        """Batches trained in the current iteration (the ``step`` of ``state_dict``)."""
        if self.config_file:
            self.load_config(self.config_file)

    def get_batch_size(self) -> int:
        """The batch size of the next batch."""
        batch_sampler = self.batch_sampler
        return int(getattr(batch_sampler, "batch_size", None) or self.batch_size or 1)

    def update_batch_size(self, batch_size: int | None = None) -> None:
        """Set the batch size of the next batches, or read it from the config file."""
        if batch_size:
            self._set_batch_size(batch_size)
        elif self.config_file:
            self.load_config(self.config_file)

    def load_config(self, config_file: str | None = None) -> None:
        """Apply ``dataloader.batch_size`` of a JSON config file whose ``dataloader.version`` is
        newer than the last applied; a missing or malformed file changes nothing (logged)."""
        path = config_file or self.config_file
        if not path or not os.path.exists(path):
            return
        try:
            with open(path) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            logger.warning("cannot read the data loader config %s: %s", path, exc)
            return
        section = config.get("dataloader") if isinstance(config, dict) else None
        if not isinstance(section, dict):
            return
        version = int(section.get("version", 0))
        if version <= self._config_version:
            return
        self._config_version = version
        batch_size = int(section.get("batch_size", 0))
        if batch_size > 0:
            self._set_batch_size(batch_size)

    def _set_batch_size(self, batch_size: int) -> None:
        batch_sampler = self.batch_sampler
        if batch_sampler is None or not hasattr(batch_sampler, "batch_size"):
            raise ValueError(
                "this DataLoader has no batch sampler whose batch size can change "
                "(batch_size=None or a custom batch_sampler)"
            )
        if batch_sampler.batch_size != batch_size:
            logger.info(
                "batch size of the data loader: %s -> %d", batch_sampler.batch_size, batch_size
            )
            batch_sampler.batch_size = batch_size

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.sampler if isinstance(self.sampler, DynamicShardSampler) else None
        self.steps_in_epoch = 0
        if sampler is None:
            for batch in super().__iter__():
                yield batch
                self.steps_in_epoch += 1
            return
        sampler.attach_consumer()
        pending = 0  # samples of the batch being trained
        for batch in super().__iter__():
            if pending:
                self.steps_in_epoch += 1
                sampler.mark_consumed(pending)
            pending = self.get_batch_size()
            yield batch
        if pending:
            self.steps_in_epoch += 1
            # The sampler caps this at what it yielded, so a short last batch counts right.
            sampler.mark_consumed(pending)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's resume state after the batches trained so far in this iteration."""
        state_dict = getattr(self.sampler, "state_dict", None)
        if state_dict is None:
            raise ValueError(
                f"the sampler {type(self.sampler).__name__} keeps no position; use "
                f"ElasticDistributedSampler or DynamicShardSampler"
            )
        state_after = getattr(self.sampler, "state_after", None)
        if state_after is not None:  # ElasticDistributedSampler: counts from a resumed place
            after: dict[str, Any] = state_after(self.steps_in_epoch * self.get_batch_size())
            return after
        result: dict[str, Any] = state_dict(self.steps_in_epoch, self.get_batch_size())
        return result

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the sampler takes it."""
        self.sampler.load_state_dict(state)  # type: ignore[attr-defined]
