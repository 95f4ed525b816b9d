"""Defaults and environment-variable names of the data-sharding subsystem."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from dlrover.constants import ENV_SHARD_LEASE_S as ENV_SHARD_LEASE_S
from dlrover.constants import ENV_SHARD_PREFETCH as ENV_SHARD_PREFETCH

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


@dataclass(frozen=True)
class ShardingEnv:
    """The sharding settings a training process reads from its environment, in one place."""

    prefetch: int = DEFAULT_PREFETCH_SHARDS
    """Shards a client keeps leased ahead (DLROVER_SHARD_PREFETCH)."""
    lease_s: float = DEFAULT_LEASE_S
    """Lease time of the datasets the elastic sampler registers (DLROVER_SHARD_LEASE_S)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ShardingEnv:
        """Read every field (unset or empty: the default); ValueError for a value that is not a
        number."""
        source = os.environ if env is None else env
        prefetch = source.get(ENV_SHARD_PREFETCH, "")
        lease = source.get(ENV_SHARD_LEASE_S, "")
        return cls(
            int(prefetch) if prefetch else DEFAULT_PREFETCH_SHARDS,
            float(lease) if lease else DEFAULT_LEASE_S,
        )
