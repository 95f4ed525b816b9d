"""The trainer's side of the embedding servers: split a batch of ids by owner, ask the servers in
parallel, put the rows back in order."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any, TypeVar

import grpc
import numpy as np
import numpy.typing as npt

from dlrover.constants import MAX_MESSAGE_BYTES, TOKEN_METADATA_KEY
from dlrover.embedding.buckets import BucketMap, IdArray
from dlrover.embedding.table import EmbeddingError, Rows
from dlrover.proto import embedding_pb2 as pb
from dlrover.proto import embedding_pb2_grpc as pb_grpc

DEFAULT_TIMEOUT_S = 30.0
"""Deadline of one call to a server."""

T = TypeVar("T")


class EmbeddingServerUnavailable(EmbeddingError):
    """A server did not answer within the deadline, or refused the token; the message names it."""


class EmbeddingClient:
    """Reaches the embedding servers at ``addresses`` (server i owns the buckets the map gives
    it). Thread-safe. Every call has a deadline; a server that does not answer raises
    EmbeddingServerUnavailable naming it."""

    def __init__(
        self,
        addresses: Sequence[str],
        token: str,
        bucket_map: BucketMap | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if not addresses:
            raise EmbeddingError("no embedding server addresses given")
        self.addresses = list(addresses)
        self.bucket_map = bucket_map or BucketMap.even(len(self.addresses))
        if self.bucket_map.num_servers > len(self.addresses):
            raise EmbeddingError(
                f"the bucket map names {self.bucket_map.num_servers} servers, "
                f"{len(self.addresses)} addresses given"
            )
        self.timeout_s = timeout_s
        self._metadata = ((TOKEN_METADATA_KEY, token),)
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
        self._channels = [grpc.insecure_channel(a, options=options) for a in self.addresses]
        self._stubs = [pb_grpc.EmbeddingServerStub(c) for c in self._channels]
        self._pool = futures.ThreadPoolExecutor(max_workers=max(1, len(self.addresses)))

    def close(self) -> None:
        """Close the channels and the call pool."""
        self._pool.shutdown(wait=False)
        for channel in self._channels:
            channel.close()

    def _call(self, server: int, method: str, request: Any) -> Any:
        try:
            response = getattr(self._stubs[server], method)(
                request, timeout=self.timeout_s, metadata=self._metadata
            )
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else None
            if code == grpc.StatusCode.UNAUTHENTICATED:
                why = "refused the job token (set DLROVER_JOB_TOKEN to the job's token)"
            else:
                why = f"did not answer within {self.timeout_s:.0f}s ({code})"
            raise EmbeddingServerUnavailable(
                f"embedding server {server} at {self.addresses[server]} {why}"
            ) from None
        if "error" in response.DESCRIPTOR.fields_by_name and response.HasField("error"):
            raise EmbeddingError(response.error.message)
        return response

    def _each_server(self, fn: Callable[[int], T]) -> list[T]:
        return list(self._pool.map(fn, range(len(self.addresses))))

    def create_table(self, spec: pb.TableSpec) -> None:
        """Create the table on every server (a no-op where it exists with the same spec)."""
        self._each_server(lambda s: self._call(s, "CreateTable", pb.CreateTableRequest(spec=spec)))

    def lookup(self, table: str, ids: IdArray, dim: int) -> Rows:
        """The rows of ``ids`` (int64, any shape -> one row per id in order)."""
        flat = _int64(ids)
        rows = np.empty((flat.size, dim), dtype=np.float32)
        parts = self._split(flat)

        def ask(server: int) -> None:
            index = parts[server]
            if index.size == 0:
                return
            request = pb.LookupRequest(table=table, ids=flat[index].astype("<i8").tobytes())
            response = self._call(server, "Lookup", request)
            if response.dim != dim:
                raise EmbeddingError(
                    f"table {table!r} has {response.dim} dims on server {server}, not {dim}"
                )
            rows[index] = np.frombuffer(response.rows, dtype="<f4").reshape(index.size, dim)

        self._each_server(ask)
        return rows

    def push(self, table: str, ids: IdArray, grads: Rows) -> None:
        """Send the gradients of the rows of ``ids`` to their servers, which apply them."""
        flat = _int64(ids)
        grads = np.ascontiguousarray(grads, dtype=np.float32)
        parts = self._split(flat)

        def send(server: int) -> None:
            index = parts[server]
            if index.size == 0:
                return
            request = pb.PushRequest(
                table=table,
                ids=flat[index].astype("<i8").tobytes(),
                grads=grads[index].astype("<f4").tobytes(),
            )
            self._call(server, "Push", request)

        self._each_server(send)

    def stats(self) -> list[list[pb.TableStats]]:
        """Per server, its tables' rows, bytes and traffic."""
        return self._each_server(lambda s: list(self._call(s, "Stats", pb.StatsRequest()).tables))

    def _split(self, flat: IdArray) -> list[npt.NDArray[np.intp]]:
        owners = self.bucket_map.owner_of(flat)
        return [np.flatnonzero(owners == s) for s in range(len(self.addresses))]


def _int64(ids: IdArray) -> IdArray:
    array = np.asarray(ids)
    if array.dtype != np.int64:
        raise EmbeddingError(f"ids must be int64, got {array.dtype} (use tensor.long())")
    return array.reshape(-1)
