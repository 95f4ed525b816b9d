"""The embedding server's API: one typed interface, the source of both ends of its RPCs.

`EmbeddingServerApi` is to the proto's ``EmbeddingServer`` service what `dlrover.api.master`
is to the master's: every public method is one RPC (``create_table`` is ``CreateTable``), its
parameters are the request's fields by name, and its result is the response's value field, or
the response itself (see `dlrover.api.rpc`). From it are derived the server's handlers
(`dlrover.embedding.server`, over `EmbeddingService`, which implements it) and the client's
typed calls (`EmbeddingClient.server(address)`). A refusal travels inside the response, in its
``error`` field, as every service's does: an `EmbeddingError` (`NotOwnerError`, `MovingError`)
raised by the server is raised by the client.

The three calls of the hot path (lookup, push, replicate) are `framed`: the server reads their
requests and writes their answers in pieces, without copying the arrays (`frames.py`), over
gRPC and over its data port alike; the bytes are the same messages.
"""

from __future__ import annotations

from typing import Protocol

from dlrover.api.mapper import Mapper
from dlrover.api.rpc import Refusal, Rpc, rpc, rpcs
from dlrover.embedding.table import EmbeddingError
from dlrover.embedding.wire import error_from_proto, error_to_proto
from dlrover.proto import embedding_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["EmbeddingServer"]
"""The proto service every method of EmbeddingServerApi is an RPC of."""

REFUSALS = (Refusal(pb.EmbeddingError, EmbeddingError, error_to_proto, error_from_proto),)
"""An embedding server's refusal: an EmbeddingError (and its NOT_OWNER and MOVING kinds)."""


class EmbeddingServerApi(Protocol):
    """What an embedding server (`dlrover-ps`) answers."""

    def create_table(self, spec: pb.TableSpec) -> bool:
        """Create a table (True); the same spec again is a no-op (False), another spec for the
        name a refusal."""
        ...

    @rpc(framed=True)
    def lookup(self, table: str, ids: bytes) -> pb.LookupResponse:
        """The rows of the ids (little-endian int64), created on first use."""
        ...

    @rpc(framed=True)
    def push(
        self, table: str, ids: bytes, grads: bytes, client: str = "", seq: int = 0
    ) -> pb.PushResponse:
        """Apply the table's optimizer with the gradients of the ids' rows: push ``seq`` of
        ``client``, unless it was applied already (``duplicate``)."""
        ...

    def stats(self) -> pb.StatsResponse:
        """Rows, memory and traffic of every table, and the server process's use."""
        ...

    def set_map(
        self, map: pb.BucketMapMessage, index: int = 0, frozen: bytes = b"", replica: int = 0
    ) -> None:
        """Take a newer map (this server's index in it, the buckets to refuse while they move,
        the replica mode); returns once no request admitted under the old one still runs."""
        ...

    def export_buckets(self, table: str, buckets: bytes, num_buckets: int) -> pb.RowsMessage:
        """The rows (and optimizer state, and the pushes they hold) of a table's ids in the
        buckets."""
        ...

    def import_rows(self, rows: pb.RowsMessage) -> int:
        """Take rows moved from another server; returns how many."""
        ...

    def drop_buckets(self, table: str, buckets: bytes, num_buckets: int) -> int:
        """Forget a table's rows in the buckets (they moved away); returns how many."""
        ...

    @rpc(framed=True)
    def replicate(self, rows: pb.RowsMessage) -> int:
        """Hold rows of the previous server (its replica); returns how many."""
        ...

    def export_replica(self, table: str, buckets: bytes, num_buckets: int) -> pb.RowsMessage:
        """The replica's rows of a table in the buckets (to restore a replacement)."""
        ...

    def resync_replica(self) -> int:
        """Send every row to the next server, which drops what it held of this one first;
        returns the rows sent."""
        ...

    def get_placement(self) -> pb.BucketMapMessage | None:
        """The map this server routes by (None before its first set_map)."""
        ...

    def applied_pushes(self, client: str, table: str = "") -> pb.AppliedPushesResponse:
        """The client's pushes this server holds as applied to the table (to any table,
        counting none that was not, when no table is named)."""
        ...

    @rpc("DataPort")
    def get_data_port(self) -> int:
        """The TCP port that also takes lookup, push and replicate (dataport.py); 0: none."""
        ...


RPCS: dict[str, Rpc] = rpcs(EmbeddingServerApi, mapper=Mapper(), service=SERVICE, refusals=REFUSALS)
"""Every RPC of the embedding server, by the interface method that is its source."""

BY_NAME: dict[str, Rpc] = {call.name: call for call in RPCS.values()}
"""The same, by the proto's RPC name (``"Lookup"``)."""
