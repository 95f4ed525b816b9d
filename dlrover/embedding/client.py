"""The trainer's side of the embedding servers: split a batch of ids by owner, ask the servers in
parallel, put the rows back in order; follow the bucket map when servers are added or removed."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import numpy as np
import numpy.typing as npt

from dlrover.api.rpc import Rpc, derive_client
from dlrover.backoff import Backoff
from dlrover.constants import TOKEN_METADATA_KEY
from dlrover.embedding import frames
from dlrover.embedding.api import BY_NAME, RPCS, SERVICE, EmbeddingServerApi
from dlrover.embedding.buckets import BucketMap, IdArray
from dlrover.embedding.dataport import (
    BUSY,
    FAILED,
    LOOKUP,
    PUSH,
    TOKEN,
    DataChannel,
    DataPortError,
    DataPortRefused,
)
from dlrover.embedding.replica import PUSH_WINDOW
from dlrover.embedding.table import EmbeddingError, Rows
from dlrover.embedding.wire import (
    MAX_MESSAGE_BYTES,
    MovingError,
    NotOwnerError,
    Placement,
    chunk_ids,
    error_from_proto,
)
from dlrover.proto import embedding_pb2 as pb

logger = logging.getLogger(__name__)

SERVICE_PATH = "/" + SERVICE.full_name
"""The servers' gRPC service, as its methods' paths begin."""
DATA_METHODS = {"Lookup": LOOKUP, "Push": PUSH}
"""The methods a server's data port takes, by their gRPC names."""
DEFAULT_TIMEOUT_S = 30.0
"""Deadline of one call to a server."""
DEFAULT_SETTLE_S = 60.0
"""Longest a request waits for buckets that are being moved between servers."""

T = TypeVar("T")
Index = npt.NDArray[np.intp]
Call = Callable[[str, Index, int], None]
"""One request for a share of the ids: (server address, positions of the ids, push number)."""


class EmbeddingServerUnavailable(EmbeddingError):
    """A server did not answer (and no replacement came within ``settle_s``); the message names
    it."""


@dataclass(frozen=True)
class FailoverGap:
    """What a server's failover lost of this client's updates: the pushes the failed server had
    acknowledged that the replica it was restored from did not hold (ASYNC replicas lag up to
    about 50 ms; SYNC ones lose none). ElasticEmbedding pushes once per table and step, so
    ``pushes`` is also the steps of updates lost to this worker."""

    index: int
    failed: str
    replacement: str
    pushes: int
    rows: int


_Calls = derive_client("_Calls", RPCS)


class ServerCalls(_Calls, EmbeddingServerApi):  # type: ignore[misc, valid-type]
    """The typed calls of one server (`EmbeddingServerApi`, derived): each with the client's
    deadline and token; a refusal raises its EmbeddingError, a server that does not answer
    EmbeddingServerUnavailable."""

    def __init__(self, client: EmbeddingClient, address: str) -> None:
        self._client = client
        self.address = address

    def invoke(self, call: Rpc, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One RPC with these arguments: its request encoded, sent, its answer decoded."""
        request = call.encode_request(args, kwargs)
        method = self._client._method(self.address, call)
        return call.decode_response(self._client._invoke(self.address, method, request))


class EmbeddingClient:
    """Reaches the embedding servers of a placement (server i at ``addresses[i]`` owns the
    buckets the map gives it). Thread-safe. Every call has a deadline; a server that does not
    answer raises EmbeddingServerUnavailable naming it. A server that no longer owns some ids
    answers with its newer placement, which the client adopts and routes by; ids of buckets
    being moved are asked again (bounded by ``settle_s``)."""

    def __init__(
        self,
        addresses: Sequence[str],
        token: str,
        bucket_map: BucketMap | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        settle_s: float = DEFAULT_SETTLE_S,
        data_port: bool = True,
    ) -> None:
        if not addresses:
            raise EmbeddingError("no embedding server addresses given")
        bucket_map = bucket_map or BucketMap.even(len(addresses))
        if bucket_map.num_servers > len(addresses):
            raise EmbeddingError(
                f"the bucket map names {bucket_map.num_servers} servers, "
                f"{len(addresses)} addresses given"
            )
        self.placement = Placement(bucket_map, tuple(addresses))
        self.timeout_s = timeout_s
        self.settle_s = settle_s
        self._metadata = ((TOKEN_METADATA_KEY, token),)
        self._token = token
        self._use_data_port = data_port
        self._data: dict[str, DataChannel | None] = {}
        """Per server address: its data port's connections (None: Lookup and Push go over
        gRPC: no data port, or it could not be reached)."""
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._methods: dict[tuple[str, str], grpc.UnaryUnaryMultiCallable] = {}
        self._pool = futures.ThreadPoolExecutor(max_workers=8)
        self.client_id = uuid.uuid4().hex
        self._seq = 0
        self._acked: dict[str, deque[tuple[str, int, int]]] = {}
        """Per server: (table, number, ids) of its last acknowledged pushes, to tell a
        failover's gap."""
        self.failover_gaps: list[FailoverGap] = []
        """One per failover this client followed, with what it lost (see FailoverGap)."""

    @property
    def addresses(self) -> tuple[str, ...]:
        """Server i's address, in the placement the client routes by now."""
        return self.placement.addresses

    @property
    def bucket_map(self) -> BucketMap:
        """The bucket map the client routes by now."""
        return self.placement.map

    def close(self) -> None:
        """Close the channels and the call pool."""
        self._pool.shutdown(wait=False)
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._methods.clear()
            data, self._data = self._data, {}
        for conns in data.values():
            if conns is not None:
                conns.close()

    def adopt(self, placement: Placement) -> bool:
        """Route by ``placement`` from now on if it is newer than the current one. A server
        replaced in it (same index, new address) is asked which of this client's pushes it
        holds: those the failed one acknowledged and the replica lacked are logged as lost."""
        with self._lock:
            old = self.placement
            if placement.map.version <= old.map.version:
                return False
            self.placement = placement
            replaced = [
                (i, was, now)
                for i, (was, now) in enumerate(
                    zip(old.addresses, placement.addresses, strict=False)
                )
                if was != now
            ]
        for index, failed, replacement in replaced:
            self._tell_gap(index, failed, replacement)
        return True

    def _tell_gap(self, index: int, failed: str, replacement: str) -> None:
        with self._lock:
            acked = list(self._acked.pop(failed, ()))
        if not acked:
            return
        lost: list[tuple[int, int]] = []
        # Per table: what a server holds as applied (a floor included) speaks for one table.
        for table in sorted({t for t, _, _ in acked}):
            try:
                held = self.server(replacement).applied_pushes(self.client_id, table)
            except EmbeddingError as e:
                logger.warning(
                    "embedding server %d: cannot tell what its failover lost: %s", index, e
                )
                return
            known = set(held.seqs)
            lost += [
                (s, n) for t, s, n in acked if t == table and s > held.floor and s not in known
            ]
        gap = FailoverGap(index, failed, replacement, len(lost), sum(n for _, n in lost))
        self.failover_gaps.append(gap)
        log = logger.warning if gap.pushes else logger.info
        log(
            "embedding server %d failed over (%s -> %s): %d pushes (%d rows) it had acknowledged "
            "to this worker are not in the replica it was restored from%s",
            index, failed, replacement, gap.pushes, gap.rows,
            ": those updates are lost (ASYNC replicas lag up to ~50 ms)" if gap.pushes else "",
        )  # fmt: skip

    def server(self, address: str) -> ServerCalls:
        """The typed calls (`EmbeddingServerApi`) of the server at ``address``."""
        return ServerCalls(self, address)

    def call(self, address: str, method: str, request: Any) -> Any:
        """One RPC by its proto name (``"Stats"``) with its request message, to the server at
        ``address``: the response message; its refusal raised as an EmbeddingError."""
        call = BY_NAME[method]
        response = self._invoke(address, self._method(address, call), request)
        call.raise_refusal(response)
        return response

    def _channel(self, address: str) -> grpc.Channel:
        """The channel to the server at ``address`` (opened once); under the lock."""
        channel = self._channels.get(address)
        if channel is None:
            options = [
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ]
            channel = self._channels[address] = grpc.insecure_channel(address, options=options)
        return channel

    def _method(self, address: str, call: Rpc) -> grpc.UnaryUnaryMultiCallable:
        """``call``'s gRPC method on the server at ``address``, its messages parsed by gRPC."""
        with self._lock:
            method = self._methods.get((address, call.name))
            if method is None:
                method = self._methods[(address, call.name)] = self._channel(address).unary_unary(
                    f"{SERVICE_PATH}/{call.name}",
                    request_serializer=call.request_type.SerializeToString,
                    response_deserializer=call.response_type.FromString,
                )
            return method

    def _raw(self, address: str, method: str) -> Callable[..., bytes]:
        """``method`` of the server at ``address`` taking and giving the message's bytes (the
        hot path encodes and decodes them itself: frames.py)."""
        with self._lock:
            return self._channel(address).unary_unary(f"{SERVICE_PATH}/{method}")

    def _invoke(self, address: str, rpc: Callable[..., T], request: Any) -> T:
        """``rpc(request)`` with the deadline and the token; a failed call raised as
        EmbeddingServerUnavailable (or EmbeddingError for a refused token) naming the server."""
        started = time.monotonic()
        try:
            return rpc(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else None
            details = (e.details() if isinstance(e, grpc.Call) else str(e)) or ""
            server = self._name(address)
            if code == grpc.StatusCode.UNAUTHENTICATED:
                raise EmbeddingError(
                    f"{server} refused the job token (set DLROVER_JOB_TOKEN to the job's token)"
                ) from None
            raise EmbeddingServerUnavailable(
                f"{server} {_why(code, details, time.monotonic() - started, self.timeout_s)}"
            ) from None

    def _name(self, address: str) -> str:
        """How messages name the server at ``address``."""
        addresses = self.addresses
        if address in addresses:
            return f"embedding server {addresses.index(address)} at {address}"
        return f"embedding server at {address}"

    @contextlib.contextmanager
    def _request(
        self, address: str, method: str, parts: list[bytes | memoryview]
    ) -> Iterator[bytes | memoryview]:
        """Send ``method``'s request message made of ``parts`` to the server at ``address``
        (over its data port, else gRPC) and yield the response message's bytes, valid inside
        the block; errors as ``call``'s."""
        channel = self._data_channel(address)
        if channel is None:
            yield self._invoke(address, self._raw(address, method), frames.join(parts))
            return
        try:
            with channel.request(DATA_METHODS[method], parts, self.timeout_s) as payload:
                yield payload
        except DataPortError as e:
            # Ask where its data port is again next time: a server back at the same address
            # is a new process with a new port.
            with self._lock:
                if self._data.get(address) is channel:
                    del self._data[address]
            channel.close()
            why = f"did not answer within {self.timeout_s:g}s" if e.timed_out else (
                f"is not reachable (connection lost: {e})"
            )  # fmt: skip
            raise EmbeddingServerUnavailable(f"{self._name(address)} {why}") from None
        except DataPortRefused as e:
            name = self._name(address)
            if e.status == TOKEN:
                raise EmbeddingError(
                    f"{name} refused the job token (set DLROVER_JOB_TOKEN to the job's token)"
                ) from None
            if e.status == BUSY:  # asked again, as a server busy over gRPC is
                raise MovingError(f"{name}: {e}") from None
            if e.status == FAILED:  # as gRPC's UNKNOWN: asked again, a push with its number
                raise EmbeddingServerUnavailable(f"{name} failed: {e}") from None
            raise EmbeddingError(f"{name} refused the request: {e}") from None

    def _data_channel(self, address: str) -> DataChannel | None:
        """The data port connections of the server at ``address``, asked for and opened on
        first use; None when it has none (an older server) or it cannot be reached (a
        firewall): then Lookup and Push go over gRPC, which reaches it."""
        with self._lock:
            if address in self._data or not self._use_data_port:
                return self._data.get(address)
        try:
            port = self.server(address).get_data_port()
        except EmbeddingServerUnavailable as e:
            if "UNIMPLEMENTED" not in str(e):
                raise
            port = 0
        channel: DataChannel | None = None
        if port:
            channel = DataChannel(address.rsplit(":", 1)[0].strip("[]"), port, self._token)
            try:
                channel.connect()
            except DataPortError as e:
                logger.warning(
                    "%s: its data port %d cannot be reached (%s): lookups and pushes go "
                    "over gRPC (slower)",
                    self._name(address),
                    port,
                    e,
                )
                channel = None
        with self._lock:
            kept = self._data.setdefault(address, channel)
        if kept is not channel and channel is not None:
            channel.close()  # another thread opened one first
        return kept

    def each_server(self, fn: Callable[[str], T]) -> list[T]:
        """``fn(address)`` for every server of the current placement, in parallel."""
        return list(self._pool.map(fn, self.addresses))

    def create_table(self, spec: pb.TableSpec) -> None:
        """Create the table on every server (a no-op where it exists with the same spec)."""
        self.each_server(lambda a: self.server(a).create_table(spec))

    def lookup(self, table: str, ids: IdArray, dim: int) -> Rows:
        """The rows of ``ids`` (int64, any shape -> one row per id in order)."""
        flat = _int64(ids)
        rows = np.empty((flat.size, dim), dtype=np.float32)

        def ask(address: str, index: Index, seq: int) -> None:
            request = frames.lookup_request(table, _wire_array(flat, index, "<i8"))
            with self._request(address, "Lookup", request) as raw:
                # A refusal is raised after the block: the connection stays good for the next.
                answer = frames.read_lookup_response(raw)
                fits = answer.dim == dim and len(answer.rows) == index.size * dim * 4
                if answer.error is None and fits:
                    got = np.frombuffer(answer.rows, dtype="<f4").reshape(index.size, dim)
                    if index.size == flat.size:  # the whole batch from one server: one copy
                        rows[...] = got
                    else:
                        rows[index] = got
            if answer.error is not None:
                raise error_from_proto(answer.error)
            if not fits:
                raise EmbeddingError(
                    f"table {table!r} has {answer.dim} dims at {address}, not {dim}"
                )

        self._route_chunks(flat, dim, ask)
        return rows

    def push(self, table: str, ids: IdArray, grads: Rows) -> None:
        """Send the gradients of the rows of ``ids`` to their servers, which apply them. Each
        request is numbered; one retried after its server was replaced keeps its number, so
        the replacement (which took over the numbers with the replica) does not apply it twice."""
        flat = _int64(ids)
        grads = np.ascontiguousarray(grads, dtype=np.float32)

        def send(address: str, index: Index, seq: int) -> None:
            request = frames.push_request(
                table,
                _wire_array(flat, index, "<i8"),
                _wire_array(grads, index, "<f4"),
                self.client_id,
                seq,
            )
            with self._request(address, "Push", request) as raw:
                response = pb.PushResponse.FromString(bytes(raw))
            RPCS["push"].raise_refusal(response)
            with self._lock:
                acked = self._acked.setdefault(address, deque(maxlen=PUSH_WINDOW))
                acked.append((table, seq, index.size))

        self._route_chunks(flat, grads.shape[1] if grads.ndim == 2 else 1, send)

    def _next_seq(self) -> int:
        with self._lock:
            self._seq += 1
            return self._seq

    def _route_chunks(self, flat: IdArray, dim: int, call: Call) -> None:
        """``_route`` over pieces of ``flat`` small enough for one message each."""
        step = chunk_ids(dim)
        for start in range(0, flat.size, step):
            stop = min(flat.size, start + step)

            def shifted(address: str, index: Index, seq: int, offset: int = start) -> None:
                call(address, index + offset, seq)

            self._route(flat[start:stop], shifted)

    def _route(self, flat: IdArray, call: Call) -> None:
        """``call(address, index, seq)`` for each server's share of ``flat``, in parallel. A
        share refused because its server no longer owns it or is moving it is routed again
        (a new seq: it was not applied); one whose server did not answer waits for that server's
        replacement and goes to it with the same seq (it may have been applied)."""
        pending: list[tuple[Index, int | None]] = [(np.arange(flat.size), None)]
        deadline = time.monotonic() + self.settle_s
        backoff = Backoff(0.005, 0.1)
        while pending:
            placement = self.placement
            shares: list[tuple[str, Index, int]] = []
            retried: list[bool] = []
            for index, seq in pending:
                owners = placement.map.owner_of(flat[index])
                for s in np.unique(owners).tolist():
                    part = index[owners == s]
                    shares.append((placement.addresses[s], part, seq or self._next_seq()))
                    retried.append(seq is not None)

            def attempt(share: tuple[str, Index, int]) -> EmbeddingError | None:
                try:
                    call(*share)
                    return None
                except (NotOwnerError, MovingError, EmbeddingServerUnavailable) as refusal:
                    return refusal

            outcomes = list(self._pool.map(attempt, shares))
            # A share that may have been applied (its server did not answer, now or before)
            # keeps its number wherever it goes next: the rows carry the numbers applied to
            # them when they move, so the new owner does not apply it twice.
            failed = [
                (index, seq if isinstance(o, EmbeddingServerUnavailable) or again else None)
                for (_, index, seq), again, o in zip(shares, retried, outcomes, strict=True)
                if o is not None
            ]
            # Refused shares were not applied: one new share per server next round.
            fresh = [index for index, seq in failed if seq is None]
            pending = [(index, seq) for index, seq in failed if seq is not None]
            if fresh:
                pending.append((np.sort(np.concatenate(fresh)), None))
            if not pending:
                return
            refusals = [o for o in outcomes if o is not None]
            adopted = any(
                isinstance(o, NotOwnerError) and o.newer is not None and self.adopt(o.newer)
                for o in refusals
            )
            if not adopted and any(isinstance(o, EmbeddingServerUnavailable) for o in refusals):
                adopted = self._look_for_replacement()
            if time.monotonic() > deadline:
                raise (
                    refusals[0]
                    if isinstance(refusals[0], EmbeddingServerUnavailable)
                    else (
                        EmbeddingError(
                            f"{len(pending)} shares of ids were refused for {self.settle_s:.0f}s "
                            f"(last: {refusals[0]}); is a resize or a failover stuck?"
                        )
                    )
                )
            if not adopted:
                # A hand-over is under way; nothing to wait on but the servers.
                time.sleep(backoff.next())

    def _look_for_replacement(self) -> bool:
        """Ask the servers that answer for their placement; adopt a newer one (a dead server's
        replacement). False when none is newer yet."""
        for address in self.addresses:
            try:
                found = self.server(address).get_placement()
            except EmbeddingServerUnavailable:
                continue
            if found is not None and self.adopt(Placement.from_proto(found)):
                return True
        return False

    def stats(self) -> list[pb.StatsResponse]:
        """Per server, its tables' rows, bytes and traffic, and its map version."""
        return self.each_server(lambda a: self.server(a).stats())


def _why(code: grpc.StatusCode | None, details: str, took_s: float, timeout_s: float) -> str:
    """What a failed call's status says happened, in words."""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"did not answer within {timeout_s:g}s"
    if code == grpc.StatusCode.UNAVAILABLE:
        if "refused" in details.lower():
            reason = "connection refused"
        elif "socket closed" in details.lower() or "reset" in details.lower():
            reason = f"connection lost: {details}"
        else:
            reason = details or "UNAVAILABLE"
        after = f" after {took_s:.1f}s" if took_s >= 1.0 else ""
        return f"is not reachable ({reason}){after}"
    if code is None:
        return f"failed: {details}"
    return f"failed: {code.name}: {details}"


def _wire_array(values: npt.NDArray[Any], index: Index, dtype: str) -> npt.NDArray[Any]:
    """The rows ``index`` of ``values`` C-contiguous in the wire's little-endian ``dtype``: the
    array itself when the share is the whole batch (one server, or one server's chunk) and it
    is in that type already, else one gather or conversion."""
    part = values if index.size == len(values) else values[index]
    return np.ascontiguousarray(part, dtype=dtype)


def _int64(ids: IdArray) -> IdArray:
    array = np.asarray(ids)
    if array.dtype != np.int64:
        raise EmbeddingError(f"ids must be int64, got {array.dtype} (use tensor.long())")
    return array.reshape(-1)
