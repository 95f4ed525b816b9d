"""Exceptions of the data-sharding subsystem, all under one base class."""


class ShardingError(Exception):
    """Base class of every error raised by dynamic data sharding."""


class InvalidSpecError(ShardingError, ValueError):
    """A dataset or stream spec (or a request) has a field that cannot work."""


class UnknownDatasetError(ShardingError, KeyError):
    """A request names a dataset or stream that was never registered."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown dataset"


class DatasetConflictError(ShardingError):
    """A dataset is registered again under the same name with different parameters."""


class ShardRetriesExhaustedError(ShardingError):
    """A shard failed more times than its dataset allows; the dataset cannot finish."""


class InvalidPositionError(ShardingError, ValueError):
    """A consumed-shard position does not fit the dataset it is restored into."""


class ShardingTimeoutError(ShardingError, TimeoutError):
    """A client waited past its deadline for the master (or the prefetcher)."""


class StreamSourceError(ShardingError):
    """A stream's broker cannot be reached, or its topic does not exist; the message says which
    and what to check."""
