"""Defaults and environment-variable names of the data-sharding subsystem."""

DEFAULT_LEASE_S = 600.0
"""A worker that holds a shard this long without any report loses it to another worker."""
DEFAULT_MAX_RETRIES = 5
"""How many times one shard may come back to the queue before its dataset fails."""
DEFAULT_PREFETCH_SHARDS = 2
"""Shards a client keeps leased ahead of the one it is reading."""
DEFAULT_FETCH_TIMEOUT_S = 300.0
"""Longest a client waits for its next shard before raising ShardingTimeoutError."""
DEFAULT_POLL_INTERVAL_S = 0.05
"""Pause between fetches while every remaining shard is leased to someone else."""

ENV_SHARD_PREFETCH = "DLROVER_SHARD_PREFETCH"
"""Overrides DEFAULT_PREFETCH_SHARDS for the client built by the elastic sampler."""
ENV_SHARD_LEASE_S = "DLROVER_SHARD_LEASE_S"
"""Overrides DEFAULT_LEASE_S for datasets registered by the elastic sampler."""
