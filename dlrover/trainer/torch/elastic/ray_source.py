"""RayDataSource: an elastic job as the sink of a Ray Data pipeline.

``ElasticStreamDataset(RayDataSource(ds, name="clicks"))`` trains on the rows of the Ray Data
dataset ``ds``: the pipeline (reads, ``map_batches`` preprocessing) runs once, upstream in the
Ray cluster, and the job's ranks lease ranges of its rows from the master as they lease Kafka
offset ranges: exactly once with the position in the (flash) checkpoint, or at most once.

How: the first rank to ask starts a detached Ray actor (the dataset's holder, named after the
dataset and the job) that materializes ``ds`` and owns its blocks, so they outlive any rank's
process; every rank reads the block layout from it (rows per block), and reads each leased
row range from the blocks it spans (Arrow tables from Ray's object store). The master sees
one partition of ``total rows`` records, bounded from the start; it needs no Ray.

Every rank connects to the Ray cluster first (``ray.init(address=...)``) and builds the same
``ds`` (building is lazy: only the holder runs it). The holder stays in the cluster until
``release()`` (call it once, at the end of the job) or the cluster ends.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from bisect import bisect_right
from collections.abc import Callable
from typing import Any

from dlrover.constants import ENV_JOB_NAME, ENV_MASTER_ADDR
from dlrover.sharding.errors import StreamSourceError
from dlrover.sharding.stream import StreamShard, StreamSpec
from dlrover.trainer.torch.elastic.kafka_reader import Records

NAMESPACE = "dlrover"
"""The Ray namespace of the holders."""
HOLDER_TIMEOUT_S = 600.0
"""Longest a rank waits for the holder to materialize the dataset (the whole pipeline)."""
_BLOCKS_KEPT = 2
"""Blocks a reader keeps after reading them (a range spans at most a few)."""


class _Holder:
    """The Ray actor that materializes the dataset and owns its blocks (see the module)."""

    def __init__(self, dataset: Any) -> None:
        import ray

        self._dataset = dataset.materialize()
        self._refs = self._dataset.to_arrow_refs()
        self._rows = [ray.get(ref).num_rows for ref in self._refs]

    def layout(self) -> tuple[list[int], list[Any]]:
        """The rows of each block, and the blocks (references to Arrow tables)."""
        return self._rows, self._refs


class RayDataSource:
    """The rows of a Ray Data dataset as a bounded stream (see the module); a sample is a row
    as a dict of column values (``decode`` of ElasticStreamDataset turns it into anything)."""

    def __init__(self, dataset: Any, *, name: str, timeout_s: float = HOLDER_TIMEOUT_S) -> None:
        self.dataset = dataset
        self.name = name
        self.timeout_s = timeout_s
        self._layout: tuple[list[int], list[Any]] | None = None

    @property
    def holder_name(self) -> str:
        """The holder actor's name: the dataset's name and this run of the job (its master),
        so a job run again on the same cluster does not read an earlier run's rows."""
        run = f"{os.environ.get(ENV_JOB_NAME, '')}@{os.environ.get(ENV_MASTER_ADDR, '')}"
        return f"dlrover-data-{self.name}-{hashlib.sha256(run.encode()).hexdigest()[:10]}"

    def _holder(self) -> Any:
        ray = _ray()
        remote = ray.remote(num_cpus=0)(_Holder)
        return remote.options(
            name=self.holder_name,
            namespace=NAMESPACE,
            lifetime="detached",
            get_if_exists=True,
        ).remote(self.dataset)

    def layout(self) -> tuple[list[int], list[Any]]:
        """Rows per block and the block references, from the holder (started if none is)."""
        if self._layout is None:
            ray = _ray()
            try:
                self._layout = ray.get(self._holder().layout.remote(), timeout=self.timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise StreamSourceError(
                    f"Ray Data dataset {self.name!r}: not materialized within {self.timeout_s:.0f}s "
                    f"(the holder {self.holder_name} runs the whole pipeline first); give "
                    f"RayDataSource a larger timeout_s"
                ) from None
            except ray.exceptions.RayError as error:
                raise StreamSourceError(
                    f"Ray Data dataset {self.name!r}: its holder failed to materialize it: {error}"
                ) from error
        return self._layout

    def stream_fields(self) -> dict[str, Any]:
        """One partition of every row: bounded at registration, the master needs no Ray."""
        rows, _ = self.layout()
        return {"end_offsets": ((0, sum(rows)),)}

    def open(self, spec: StreamSpec, whole_records: bool) -> _BlockReader:
        """A reader of row ranges from the blocks."""
        rows, refs = self.layout()
        return _BlockReader(self.name, rows, refs)

    def samples(
        self, partition: int, records: Records, decode: Callable[[Any], Any] | None
    ) -> list[Any]:
        """The rows (dicts), or ``decode`` of each."""
        if decode is None:
            return records.values
        return [decode(row) for row in records.values]

    def release(self) -> None:
        """End the holder and free the blocks: once, after every rank has read the stream."""
        ray = _ray()
        try:
            ray.kill(ray.get_actor(self.holder_name, namespace=NAMESPACE))
        except ValueError:
            pass  # none: already released


class _BlockReader:
    """Reads row ranges [start, end) of partition 0 from the blocks they span."""

    def __init__(self, name: str, rows: list[int], refs: list[Any]) -> None:
        self._name = name
        self._rows = rows
        self._refs = refs
        self._starts = [0, *itertools.accumulate(rows)][:-1]
        self._kept: dict[int, Any] = {}

    def prepare(self, shards: list[StreamShard]) -> None:
        """Nothing to prepare: a block is fetched when a range first needs it."""

    def read(
        self,
        shard: StreamShard,
        stopped: Callable[[], bool],
        timeout_s: float,
        poll_s: float,
        keep_alive: Callable[[], None],
    ) -> Records:
        """The rows of ``shard`` in order, as dicts; StreamSourceError when a block does not
        come within ``timeout_s`` or is lost (its holder gone)."""
        offsets: list[int] = []
        values: list[Any] = []
        position = shard.start
        block = bisect_right(self._starts, position) - 1
        while position < shard.end and not stopped():
            table = self._block(block, timeout_s)
            begin = self._starts[block]
            count = min(shard.end, begin + self._rows[block]) - position
            values += table.slice(position - begin, count).to_pylist()
            offsets += range(position, position + count)
            position += count
            block += 1
            keep_alive()
        return Records([offsets, values])

    def _block(self, index: int, timeout_s: float) -> Any:
        table = self._kept.get(index)
        if table is not None:
            return table
        ray = _ray()
        try:
            table = ray.get(self._refs[index], timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise StreamSourceError(
                f"Ray Data dataset {self._name!r}: block {index} did not arrive within "
                f"{timeout_s:.0f}s; the training position is not lost"
            ) from None
        except ray.exceptions.RayError as error:
            raise StreamSourceError(
                f"Ray Data dataset {self._name!r}: block {index} is lost ({error}); was the "
                f"holder released or the cluster restarted?"
            ) from error
        if len(self._kept) >= _BLOCKS_KEPT:
            self._kept.pop(next(iter(self._kept)))
        self._kept[index] = table
        return table

    def close(self) -> None:
        """Drop the blocks kept."""
        self._kept.clear()


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise StreamSourceError("RayDataSource needs Ray Data: pip install 'ray[data]'") from exc
    if not ray.is_initialized():
        raise StreamSourceError(
            "RayDataSource: connect to the Ray cluster first, in every rank, before building "
            "the dataset: ray.init(address=...) (else Ray Data starts a cluster of its own)"
        )
    return ray
