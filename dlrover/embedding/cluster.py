"""Adding and removing embedding servers while training runs: buckets move, nothing restarts.

A resize freezes only the buckets that change owner (their servers refuse them with MOVING
after the requests already admitted have finished), copies their rows and optimizer state to
the new owners, then installs the new map on every server. Workers never stop: a request for a
moving bucket is asked again until the new map is in place, and a server that no longer owns a
bucket answers with the new map, which the client adopts. Every update is applied exactly once,
on the server that owns the row at that moment.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dlrover.embedding.buckets import BucketMap
from dlrover.embedding.client import EmbeddingClient
from dlrover.embedding.table import EmbeddingError
from dlrover.embedding.wire import Placement, chunk_ids
from dlrover.proto import embedding_pb2 as pb

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResizeReport:
    """What a resize did: the new map version, buckets and rows moved, and how long the moving
    buckets were refused (``pause_s``; the other buckets were served throughout)."""

    version: int
    servers: int
    moved_buckets: int
    moved_rows: int
    pause_s: float
    seconds: float


class EmbeddingCluster:
    """Installs and changes the placement of the tables on the servers ``client`` reaches."""

    def __init__(self, client: EmbeddingClient) -> None:
        self.client = client

    def install(self) -> None:
        """Give every server the client's placement (a new cluster, before training)."""
        placement = self.client.placement
        for index, address in enumerate(placement.addresses):
            self._set_map(address, placement, index)

    def resize(self, addresses: Sequence[str]) -> ResizeReport:
        """Move to the servers at ``addresses``: the current servers keep their index (new ones
        go at the end; removing servers removes the last ones). Tables are created on new
        servers with the specs the current ones hold."""
        started = time.monotonic()
        old = self.client.placement
        kept = min(len(old.addresses), len(addresses))
        if tuple(addresses[:kept]) != old.addresses[:kept]:
            raise EmbeddingError(
                f"a resize keeps the first {kept} servers in place: expected "
                f"{list(old.addresses[:kept])} first, got {list(addresses[:kept])}"
            )
        specs, sizes = self._specs(old.addresses)
        for address in addresses[kept:]:
            for spec in specs:
                self.client.call(address, "CreateTable", pb.CreateTableRequest(spec=spec))
        target = old.map.resized(len(addresses))
        moves = old.map.moves(target)
        frozen = BucketMap(old.map.version + 1, old.map.owners)
        final = Placement(BucketMap(old.map.version + 2, target.owners), tuple(addresses))
        leaving: dict[int, list[int]] = defaultdict(list)
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for bucket, source, dest in moves:
            leaving[source].append(bucket)
            groups[(source, dest)].append(bucket)

        pause_start = time.monotonic()
        for index, address in enumerate(old.addresses):
            # Refuse the leaving buckets once the requests admitted before have finished.
            self._set_map(address, Placement(frozen, old.addresses), index, leaving[index])
        moved_rows = 0
        for (source, dest), buckets in sorted(groups.items()):
            for spec in specs:
                # Pieces of buckets whose rows fit a message (ids hash evenly into buckets).
                per_bucket = sizes.get(spec.name, 0) / old.map.num_buckets + 1
                step = max(1, int(chunk_ids(spec.dim) / per_bucket))
                for start in range(0, len(buckets), step):
                    request = pb.BucketsRequest(
                        table=spec.name,
                        buckets=np.asarray(buckets[start : start + step], dtype="<i8").tobytes(),
                        num_buckets=old.map.num_buckets,
                    )
                    rows = self.client.call(old.addresses[source], "ExportBuckets", request)
                    moved_rows += self.client.call(addresses[dest], "ImportRows", rows).rows
        # New owners first, so that a request the old owners send on finds its rows.
        order = sorted(range(len(addresses)), key=lambda i: i < len(old.addresses))
        for index in order:
            self._set_map(addresses[index], final, index)
        for index in range(len(addresses), len(old.addresses)):
            self._set_map(old.addresses[index], final, -1)  # removed: owns nothing, redirects
        pause_s = time.monotonic() - pause_start
        self.client.adopt(final)
        for (source, _), buckets in sorted(groups.items()):
            for spec in specs:
                self.client.call(
                    old.addresses[source],
                    "DropBuckets",
                    pb.BucketsRequest(
                        table=spec.name,
                        buckets=np.asarray(buckets, dtype="<i8").tobytes(),
                        num_buckets=old.map.num_buckets,
                    ),
                )
        report = ResizeReport(
            final.map.version,
            len(addresses),
            len(moves),
            moved_rows,
            pause_s,
            time.monotonic() - started,
        )
        logger.info(
            "embedding servers %d -> %d: %d buckets, %d rows moved; moving buckets paused %.3fs",
            len(old.addresses),
            len(addresses),
            report.moved_buckets,
            report.moved_rows,
            report.pause_s,
        )
        return report

    def _specs(self, addresses: Sequence[str]) -> tuple[list[pb.TableSpec], dict[str, int]]:
        """The tables' specs, and their rows over all servers."""
        specs: dict[str, pb.TableSpec] = {}
        rows: dict[str, int] = defaultdict(int)
        for address in addresses:
            for table in self.client.call(address, "Stats", pb.StatsRequest()).tables:
                specs.setdefault(table.name, table.spec)
                rows[table.name] += table.rows
        return [specs[name] for name in sorted(specs)], dict(rows)

    def _set_map(
        self, address: str, placement: Placement, index: int, frozen: Sequence[int] = ()
    ) -> None:
        request = pb.SetMapRequest(
            map=placement.to_proto(),
            index=index,
            frozen=np.asarray(frozen, dtype="<i8").tobytes(),
        )
        self.client.call(address, "SetMap", request)
