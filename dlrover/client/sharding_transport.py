"""The sharding interfaces, where the trainer side has always imported them (dlrover.api.sharding)."""

from __future__ import annotations

from dlrover.api.sharding import ShardingTransport, StreamTransport

__all__ = ["ShardingTransport", "StreamTransport"]
