"""The sharding calls a trainer makes to the master, one RPC per method (see dlrover.api.rpc)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from dlrover.api.rpc import Run, rpc
from dlrover.sharding.stream import (
    StreamFetchResult,
    StreamMark,
    StreamPosition,
    StreamPositionAt,
    StreamProgress,
    StreamSpec,
)
from dlrover.sharding.types import (
    ConsumptionMark,
    DatasetProgress,
    DatasetSpec,
    FetchResult,
    Position,
    PositionAt,
    RegisterResult,
    ReportResult,
    ShardId,
)


class ShardingTransport(Protocol):
    """How a ShardingClient reaches the master. Each method is one RPC of the same name.

    Every argument and result is a dataclass of dlrover.sharding.types; the gRPC transport
    (derived from this interface) sends each as the protobuf message of the same name, and a
    refusal raises its class from dlrover.sharding.errors. The master's implementation is
    dlrover.master.sharding_service.ShardingService, the in-process one for tests
    dlrover.testing.sharding.InProcessTransport. Implementations must be safe to call from
    several threads (the client's prefetcher and the training loop).
    """

    def register_dataset(self, spec: DatasetSpec) -> RegisterResult:
        """Register ``spec``: a no-op if the same spec exists, DatasetConflictError if a different
        one does."""
        ...

    def fetch_shards(self, dataset: str, worker_id: str, max_count: int) -> FetchResult:
        """Lease up to ``max_count`` shards of ``dataset`` to ``worker_id``; none and not finished
        means the rest is leased to others (ask again)."""
        ...

    def report_done(
        self, dataset: str, worker_id: str, shard_ids: Sequence[ShardId]
    ) -> ReportResult:
        """Report shards ``worker_id`` finished; counts those accepted and those that named no open
        shard."""
        ...

    def report_progress(
        self, dataset: str, worker_id: str, shard_id: ShardId, consumed: int
    ) -> bool:
        """Report that the first ``consumed`` samples (shard order) of ``shard_id`` are trained,
        renewing its lease; False if the worker no longer holds it."""
        ...

    def renew_leases(self, dataset: str, worker_id: str) -> int:
        """Extend every lease ``worker_id`` holds on ``dataset``; returns how many."""
        ...

    def get_position(self, dataset: str) -> Position:
        """The dataset's consumed position now (shards in flight are pending), to save with a
        checkpoint."""
        ...

    def mark_consumption(self, dataset: str, worker_id: str, mark: ConsumptionMark) -> None:
        """Record where ``worker_id`` stands in its iteration (see ConsumptionMark)."""
        ...

    def position_at(self, dataset: str, epoch: int, consumed: int) -> PositionAt:
        """The position once every worker had consumed ``consumed`` samples of iteration ``epoch``,
        or the workers it still waits for."""
        ...

    def restore_position(self, position: Position, token: str | None) -> bool:
        """Reset the dataset to ``position``; False when ``token`` is the one applied last (a no-op,
        so every rank may restore the same checkpoint)."""
        ...

    def dataset_progress(self, dataset: str) -> DatasetProgress:
        """The dataset's progress counters."""
        ...


class StreamTransport(Protocol):
    """How a StreamShardingClient reaches the master: one method per stream RPC of the same name
    (the gRPC transport implements both protocols; registering asks the Kafka broker, so the
    master runs it on a thread). Refusals raise their class from
    dlrover.sharding.errors; implementations must be thread-safe."""

    @rpc(run=Run.POOL)
    def register_stream(self, spec: StreamSpec) -> RegisterResult:
        """Register ``spec``: a no-op if the same spec exists, DatasetConflictError if a different
        one does; StreamSourceError if the master cannot read the topic."""
        ...

    def fetch_stream_shards(self, stream: str, worker_id: str, max_count: int) -> StreamFetchResult:
        """Lease up to ``max_count`` record ranges to ``worker_id``."""
        ...

    def report_stream_done(
        self, stream: str, worker_id: str, shards: Sequence[tuple[int, int]]
    ) -> int:
        """Report ranges, named by (partition, start), finished; returns how many counted (held
        by ``worker_id``, or back in the queue)."""
        ...

    def return_stream_shards(
        self, stream: str, worker_id: str, remainders: Sequence[tuple[int, int, int, int]]
    ) -> int:
        """Give back ranges ``worker_id`` will not read further: (partition, start, first offset
        not yielded, records yielded) each; returns how many the master took back."""
        ...

    def renew_stream_leases(self, stream: str, worker_id: str) -> int:
        """Extend every lease ``worker_id`` holds on ``stream``; returns how many."""
        ...

    def mark_stream(self, stream: str, worker_id: str, mark: StreamMark) -> bool:
        """Record where ``worker_id`` stands in its pass (see StreamMark); False when it does not
        hold the marked range (its lease expired): it must not yield it."""
        ...

    def mark_stream_ranges(self, stream: str, worker_id: str, marks: Sequence[StreamMark]) -> int:
        """``mark_stream`` for several ranges, in the order the worker yields them; returns how
        many, from the first, were recorded: the next one names a range the worker no longer
        holds (it must skip it) and the rest were not looked at (mark them again)."""
        ...

    def stream_position_at(self, stream: str, consumed: int) -> StreamPositionAt:
        """The position once every worker had yielded ``consumed`` records, or who it waits for."""
        ...

    def restore_stream_position(self, position: StreamPosition, token: str | None) -> bool:
        """Restart the stream at ``position``; False when ``token`` is the one applied last."""
        ...

    def stop_stream(self, stream: str) -> StreamProgress:
        """Cut no new shards: the stream ends once the ranges in flight are done."""
        ...

    def stream_progress(self, stream: str) -> StreamProgress:
        """The stream's counters: committed and end offsets per partition."""
        ...
