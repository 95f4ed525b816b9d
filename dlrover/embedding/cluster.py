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


class ResizeStuckError(EmbeddingError):
    """A resize failed after some servers took its final map: neither map holds everywhere, and
    training cannot go on safely (updates may have landed under the new one)."""


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


@dataclass(frozen=True)
class ReplaceReport:
    """A failed server replaced from its replica: rows restored; how long before the replacement
    the replica last heard from the failed server (with SYNC it held every acknowledged update;
    with ASYNC, updates acknowledged in the last ASYNC_LAG_S before the failure may be missing,
    and the log says so); and how long the replacement took (the failed server's ids waited
    that long)."""

    version: int
    index: int
    restored_rows: int
    last_heard_s: float
    seconds: float
    serving_after_s: float = 0.0
    """From the call to the replacement serving (the rest re-sends replicas in the background
    of training)."""


class EmbeddingCluster:
    """Installs and changes the placement of the tables on the servers ``client`` reaches.

    ``replica`` is how each server keeps its rows on the next server: ``pb.ASYNC`` (default:
    changes follow within about 50 ms), ``pb.SYNC`` (an update is acknowledged once the replica
    holds it: a failover loses nothing) or ``pb.NO_REPLICA``.
    """

    def __init__(self, client: EmbeddingClient, replica: int = pb.ASYNC) -> None:
        self.client = client
        self.replica = replica

    def install(self) -> None:
        """Give every server the client's placement (a new cluster, before training)."""
        placement = self.client.placement
        for index, address in enumerate(placement.addresses):
            self._set_map(address, placement, index)

    def replace(self, index: int, address: str) -> ReplaceReport:
        """Replace the failed server ``index`` by the (new, empty) server at ``address``: its
        rows come from its replica on the next server, then every server routes to it. Workers
        keep running; their requests to the failed server wait for the replacement."""
        started = time.monotonic()
        old = self.client.placement
        n = len(old.addresses)
        if n < 2 or self.replica == pb.NO_REPLICA:
            raise EmbeddingError(
                "a server can be replaced from a replica only with 2 or more servers and "
                "replicas on"
            )
        holder = old.addresses[(index + 1) % n]
        live = [a for i, a in enumerate(old.addresses) if i != index]
        specs, sizes = self._specs(live)
        for spec in specs:
            self.client.server(address).create_table(spec)
        mine = [b for b, owner in enumerate(old.map.owners) if owner == index]
        restored, heard = 0, 0.0
        for spec in specs:
            for buckets in self._pieces(mine, spec, sizes, old.map.num_buckets):
                rows = self.client.server(holder).export_replica(
                    spec.name, buckets, old.map.num_buckets
                )
                heard = max(heard, rows.age_s)
                rows.table = spec.name
                restored += self.client.server(address).import_rows(rows)
        addresses = list(old.addresses)
        addresses[index] = address
        new = Placement(BucketMap(old.map.version + 1, old.map.owners), tuple(addresses))
        order = [index] + [i for i in range(n) if i != index]
        for i in order:
            self._set_map(addresses[i], new, i)
        serving_after_s = time.monotonic() - started
        # The replacement's rows go to its next server; its previous server's to it.
        for i in (index, (index - 1) % n):
            self.client.server(addresses[i]).resync_replica()
        self.client.adopt(new)
        report = ReplaceReport(
            new.map.version, index, restored, heard, time.monotonic() - started, serving_after_s
        )
        logger.info(
            "embedding server %d replaced by %s in %.2fs: %d rows from the replica, which last "
            "heard from it %.3fs before (%s)",
            index,
            address,
            report.seconds,
            restored,
            heard,
            "SYNC: nothing acknowledged is missing"
            if self.replica == pb.SYNC
            else "ASYNC: updates acknowledged in the last 50 ms before the failure may be missing",
        )
        return report

    def _pieces(
        self, buckets: list[int], spec: pb.TableSpec, sizes: dict[str, int], num_buckets: int
    ) -> list[bytes]:
        """``buckets`` of a table in pieces whose rows fit a message (little-endian int64)."""
        per_bucket = sizes.get(spec.name, 0) / num_buckets + 1
        step = max(1, int(chunk_ids(spec.dim) / per_bucket))
        return [
            np.asarray(buckets[start : start + step], dtype="<i8").tobytes()
            for start in range(0, len(buckets), step)
        ]

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
                self.client.server(address).create_table(spec)
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
        moved_rows = 0
        try:
            for index, address in enumerate(old.addresses):
                # Refuse the leaving buckets once the requests admitted before have finished.
                self._set_map(address, Placement(frozen, old.addresses), index, leaving[index])
            for (source, dest), buckets in sorted(groups.items()):
                for spec in specs:
                    # Pieces of buckets whose rows fit a message (ids hash evenly into buckets).
                    for piece in self._pieces(buckets, spec, sizes, old.map.num_buckets):
                        rows = self.client.server(old.addresses[source]).export_buckets(
                            spec.name, piece, old.map.num_buckets
                        )
                        moved_rows += self.client.server(addresses[dest]).import_rows(rows)
        except EmbeddingError as e:
            # Nothing was handed over yet: the old owners still hold every row. Unfreeze them.
            back = self.roll_back(old)
            raise EmbeddingError(
                f"resize to {len(addresses)} servers failed and was rolled back to map version "
                f"{back.map.version} ({len(old.addresses)} servers): {e}"
            ) from None
        # New owners first, so that a request the old owners send on finds its rows.
        order = sorted(range(len(addresses)), key=lambda i: i < len(old.addresses))
        try:
            for index in order:
                self._set_map(addresses[index], final, index)
            for index in range(len(addresses), len(old.addresses)):
                self._set_map(old.addresses[index], final, -1)  # removed: owns nothing
        except EmbeddingError as e:
            raise ResizeStuckError(
                f"resize to {len(addresses)} servers failed while its map (version "
                f"{final.map.version}) was being installed, some servers have it: {e}"
            ) from None
        pause_s = time.monotonic() - pause_start
        self.client.adopt(final)
        self.finish(old, final)
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

    def roll_back(self, old: Placement) -> Placement:
        """Undo a resize that handed nothing over yet: the old servers get the old map again,
        unfrozen, at a version newer than any the resize used. Best effort per server."""
        back = Placement(BucketMap(old.map.version + 3, old.map.owners), old.addresses)
        for index, address in enumerate(old.addresses):
            try:
                self._set_map(address, back, index)
            except EmbeddingError as e:
                logger.error("embedding server %d: cannot roll its map back: %s", index, e)
        self.client.adopt(back)
        return back

    def finish(self, old: Placement, final: Placement) -> None:
        """After the final map of a resize is installed: the old owners drop the rows that
        moved, and the replicas are sent whole again (they cover other buckets now)."""
        groups: dict[int, list[int]] = defaultdict(list)
        for bucket, source, _ in old.map.moves(final.map):
            groups[source].append(bucket)
        specs, _ = self._specs(final.addresses)
        for source, buckets in sorted(groups.items()):
            for spec in specs:
                self.client.server(old.addresses[source]).drop_buckets(
                    spec.name, np.asarray(buckets, dtype="<i8").tobytes(), old.map.num_buckets
                )
        if self.replica != pb.NO_REPLICA:
            for address in final.addresses:
                self.client.server(address).resync_replica()

    def _specs(self, addresses: Sequence[str]) -> tuple[list[pb.TableSpec], dict[str, int]]:
        """The tables' specs, and their rows over all servers."""
        specs: dict[str, pb.TableSpec] = {}
        rows: dict[str, int] = defaultdict(int)
        for address in addresses:
            for table in self.client.server(address).stats().tables:
                specs.setdefault(table.name, table.spec)
                rows[table.name] += table.rows
        return [specs[name] for name in sorted(specs)], dict(rows)

    def _set_map(
        self, address: str, placement: Placement, index: int, frozen: Sequence[int] = ()
    ) -> None:
        self.client.server(address).set_map(
            placement.to_proto(), index, np.asarray(frozen, dtype="<i8").tobytes(), self.replica
        )
