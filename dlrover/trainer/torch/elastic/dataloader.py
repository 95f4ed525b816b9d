"""ElasticDataLoader: a DataLoader that tells its elastic sampler which samples were trained."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset

from dlrover.trainer.torch.elastic.sampler import ElasticDistributedSampler


class ElasticDataLoader(DataLoader):
    """DataLoader over an ElasticDistributedSampler (built for you when none is given).

    Batch k counts as trained when batch k+1 is asked for (or the loop ends), and the
    sampler is told so: shards are reported done exactly when their samples are trained,
    whatever the prefetching of DataLoader workers. `batch_size` is the micro-batch size;
    ElasticTrainer turns it into a fixed global batch with gradient accumulation.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int = 1,
        sampler: ElasticDistributedSampler | None = None,
        **kwargs: Any,
    ) -> None:
        if sampler is None:
            sampler = ElasticDistributedSampler(dataset)  # type: ignore[arg-type]
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, **kwargs)
        self.elastic_sampler = sampler
        self.steps_in_epoch = 0
        """Batches trained in the current iteration: the `step` of `state_dict`."""

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self.elastic_sampler.attach_consumer()
        self.steps_in_epoch = 0
        batch_size = self.batch_size or 1
        started = False
        for batch in super().__iter__():
            if started:
                self.steps_in_epoch += 1
                self.elastic_sampler.mark_consumed(batch_size)
            started = True
            yield batch
        if started:
            self.steps_in_epoch += 1
            # The sampler caps this at what it yielded, so a short last batch counts right.
            self.elastic_sampler.mark_consumed(batch_size)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's resume state after the batches trained so far in this iteration."""
        return self.elastic_sampler.state_dict(self.steps_in_epoch, self.batch_size or 1)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the sampler takes it (see
        ElasticDistributedSampler.load_state_dict)."""
        self.elastic_sampler.load_state_dict(state)
