"""The embedding server (`dlrover-ps`): sparse tables behind gRPC, numpy arrays on the wire."""

from __future__ import annotations

import functools
import logging
import secrets
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import grpc
import numpy as np
import psutil
from google.protobuf.message import DecodeError, Message

from dlrover.constants import TOKEN_METADATA_KEY
from dlrover.embedding import frames
from dlrover.embedding.buckets import bucket_of
from dlrover.embedding.dataport import LOOKUP, PUSH, REPLICATE, DataPortServer
from dlrover.embedding.replica import (
    AppliedPushes,
    Claim,
    ReplicaSender,
    ReplicaStore,
    claims,
    combined,
    rows_from_message,
    rows_message,
)
from dlrover.embedding.table import EmbeddingError, EmbeddingTable, Optimizer, Rows
from dlrover.embedding.wire import (
    MAX_MESSAGE_BYTES,
    MovingError,
    NotOwnerError,
    Placement,
    buckets_from_bytes,
    error_to_proto,
)
from dlrover.proto import embedding_pb2 as pb
from dlrover.proto import embedding_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

R = TypeVar("R")

DEFAULT_THREADS = 8
"""Request threads of a server."""
RESERVED_THREADS = 2
"""Threads lookups and pushes never take: replication and control calls always find one."""


def spec_to_table(spec: pb.TableSpec) -> EmbeddingTable:
    """The empty table a spec describes; EmbeddingError for one that cannot work."""
    optimizer = Optimizer(spec.optimizer or "adagrad", spec.lr or 0.01, spec.initial_accumulator)
    return EmbeddingTable(
        spec.name,
        spec.dim,
        optimizer,
        seed=spec.seed,
        init_scale=spec.init_scale if spec.init_scale > 0 else None,
    )


def ids_from_bytes(data: bytes | memoryview) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Little-endian int64 ids; EmbeddingError when the byte count is not a multiple of 8."""
    if len(data) % 8:
        raise EmbeddingError(f"ids must be int64: got {len(data)} bytes, not a multiple of 8")
    return np.frombuffer(data, dtype="<i8").astype(np.int64, copy=False)


@dataclass
class _Served:
    table: EmbeddingTable
    spec: pb.TableSpec
    lock: threading.Lock = field(default_factory=threading.Lock)
    lookups: int = 0
    pushes: int = 0
    applied: AppliedPushes = field(default_factory=AppliedPushes)
    """The pushes applied to this table, per client (a retried push is not applied twice)."""


class EmbeddingService(pb_grpc.EmbeddingServerServicer):
    """The tables of one server, each behind its own lock (lookups of different tables run in
    parallel; numpy releases the GIL in its large copies)."""

    def __init__(self, token: str = "", threads: int = DEFAULT_THREADS) -> None:
        self._token = token
        # Lookups and pushes may hold at most this many of the server's threads: the others stay
        # free for Replicate calls (two servers pushing SYNC to each other with every thread
        # waiting on the other would deadlock) and for the control calls.
        self._admit = max(1, threads - RESERVED_THREADS)
        self._tables: dict[str, _Served] = {}
        self._lock = threading.Lock()
        # Replicas: what this server sends to the next one, and what it holds of the previous one.
        self._sender: ReplicaSender | None = None
        self.replica = ReplicaStore(spec_to_table)
        # Ownership: no map yet serves every id (a lone server). Requests in flight are
        # counted so that a freeze waits for them before rows move.
        self._gate = threading.Condition()
        self._process = psutil.Process()  # its CPU and memory, for Stats
        self._process.cpu_percent(None)  # the first call only starts the count
        self._placement: Placement | None = None
        self._index = 0
        self._owned = np.empty(0, dtype=bool)
        self._frozen = np.empty(0, dtype=bool)
        self._active: dict[int, int] = {}
        """Map version -> requests admitted under it and still running."""
        self._busy = 0
        self.data_port = 0
        """The port of the server's DataPortServer, once it has one."""
        self.moved_in = 0
        self.moved_out = 0

    def _enter(self, ids: np.ndarray[Any, np.dtype[np.int64]]) -> int:
        """Admit a request for ``ids`` (returns the map version it runs under, for `_leave`), or
        raise NotOwnerError / MovingError (moving, or every request thread busy: ask again)."""
        with self._gate:
            if self._busy >= self._admit:
                raise MovingError(f"server {self._index} is busy: ask again shortly")
            placement = self._placement
            if placement is not None and ids.size:
                buckets = bucket_of(ids, placement.map.num_buckets)
                if not self._owned[buckets].all():
                    raise NotOwnerError(
                        f"ids of buckets server {self._index} does not own at map version "
                        f"{placement.map.version}",
                        placement,
                    )
                if self._frozen[buckets].any():
                    raise MovingError(f"ids of buckets moving away from server {self._index}")
            version = placement.map.version if placement is not None else 0
            self._active[version] = self._active.get(version, 0) + 1
            self._busy += 1
            return version

    def _leave(self, version: int) -> None:
        with self._gate:
            self._busy -= 1
            self._active[version] -= 1
            if not self._active[version]:
                del self._active[version]
            self._gate.notify_all()

    def SetMap(  # noqa: N802
        self, request: pb.SetMapRequest, context: grpc.ServicerContext
    ) -> pb.SetMapResponse:
        """Take a newer map (and the buckets to refuse while they move); returns once no request
        admitted under the old one is still running."""

        def run() -> pb.SetMapResponse:
            placement = Placement.from_proto(request.map)
            new = placement.map
            frozen = buckets_from_bytes(request.frozen, new.num_buckets)
            if not -1 <= request.index < len(placement.addresses):
                raise EmbeddingError(
                    f"server index {request.index} is not in the map's "
                    f"{len(placement.addresses)} servers (-1: removed)"
                )
            if request.replica not in pb.ReplicaMode.values():
                raise EmbeddingError(
                    f"unknown replica mode {request.replica} (known: "
                    f"{', '.join(pb.ReplicaMode.keys())}): is the server older than the master?"
                )
            with self._gate:
                old = self._placement
                if old is not None and new.version < old.map.version:
                    raise EmbeddingError(
                        f"map version {new.version} is older than this server's {old.map.version}"
                    )
                self._placement, self._index = placement, request.index
                retired = self._replicate_to(placement, request.index, request.replica)
                self._owned = np.asarray(new.owners) == request.index
                self._frozen = np.zeros(new.num_buckets, dtype=bool)
                self._frozen[frozen] = True

                def old_ones_done() -> bool:
                    return all(v >= new.version for v in self._active)

                done = self._gate.wait_for(old_ones_done, timeout=60.0)
            if retired is not None:
                retired.close()  # outside the gate: its thread may take a while to stop
            if not done:
                raise EmbeddingError("requests under the old map did not end within 60s")
            return pb.SetMapResponse()

        return _answer(pb.SetMapResponse, run)

    def close(self) -> None:
        """Stop sending to the replica."""
        if self._sender is not None:
            self._sender.close()
            self._sender = None

    def _replicate_to(self, placement: Placement, index: int, mode: int) -> ReplicaSender | None:
        """Send this server's changes to the next server of ``placement`` in ``mode``; returns
        the sender it replaces, for the caller to close."""
        n = len(placement.addresses)
        target = placement.addresses[(index + 1) % n] if index >= 0 and n > 1 else None
        if mode == pb.NO_REPLICA:
            target = None
        sender = self._sender
        retired = None
        if sender is not None and (sender.address != target or sender.mode != mode):
            retired, sender = sender, None
        if sender is None and target is not None:
            sender = ReplicaSender(target, self._token, mode)
            if mode == pb.ASYNC:
                sender.start(self._flush)
        self._sender = sender
        return retired

    def _flush(self, tables: list[str]) -> None:
        """ASYNC: send the marked rows of ``tables`` with the pushes that changed them."""
        sender = self._sender
        if sender is None:
            return
        failed: EmbeddingError | None = None
        for name in tables:
            served = self._table(name)
            with served.lock:
                # Taken with the rows, under the lock: the values hold the pushes marked with
                # them (and those sent before), and the message claims no other push.
                marked = sender.take_marked(name)
                if marked is None:
                    continue
                taken, pushes = marked
                ids = taken[served.table.holds(taken)]  # rows that moved away since: not ours
                rows, accum = served.table.snapshot(ids)
            try:
                sender.send(rows_message(served.spec, ids, rows, accum, claims(pushes)))
            except EmbeddingError as e:  # the next round sends them (with newer values)
                sender.mark(name, taken, pushes)
                failed = failed or e
        if failed is not None:
            raise failed

    def Replicate(  # noqa: N802
        self, request: pb.RowsMessage, context: grpc.ServicerContext
    ) -> pb.ImportResponse:
        """Hold rows of the previous server (its replica)."""
        return _answer(
            pb.ImportResponse, lambda: pb.ImportResponse(rows=self.replica.take(request))
        )

    def ExportReplica(  # noqa: N802
        self, request: pb.BucketsRequest, context: grpc.ServicerContext
    ) -> pb.RowsMessage:
        """The replica's rows of a table in the buckets (to restore a replacement)."""

        def run() -> pb.RowsMessage:
            buckets = buckets_from_bytes(request.buckets, request.num_buckets)
            return self.replica.export(request.table, buckets, request.num_buckets)

        return _answer(pb.RowsMessage, run)

    def ResyncReplica(  # noqa: N802
        self, request: pb.StatsRequest, context: grpc.ServicerContext
    ) -> pb.ImportResponse:
        """Send every row to the next server, which drops what it held of this one first."""

        def run() -> pb.ImportResponse:
            sender = self._sender
            if sender is None:
                return pb.ImportResponse(rows=0)
            with self._lock:
                served = list(self._tables.values())
            sent = 0
            for entry in served:
                with entry.lock:
                    sent += sender.send_all(entry.spec, entry.table, entry.applied.entries())
            return pb.ImportResponse(rows=sent)

        return _answer(pb.ImportResponse, run)

    def AppliedPushes(  # noqa: N802
        self, request: pb.AppliedPushesRequest, context: grpc.ServicerContext
    ) -> pb.AppliedPushesResponse:
        """The client's pushes this server holds as applied to the table (to any table, counting
        none that was not, when no table is named)."""
        with self._lock:
            served = list(self._tables.values())
        if request.table:
            served = [s for s in served if s.table.name == request.table]
            if not served:
                return pb.AppliedPushesResponse(seqs=[], floor=-1)
        seqs, floor = combined([s.applied for s in served], request.client)
        return pb.AppliedPushesResponse(seqs=seqs, floor=floor)

    def DataPort(  # noqa: N802
        self, request: pb.StatsRequest, context: grpc.ServicerContext
    ) -> pb.DataPortResponse:
        """The TCP port that also takes Lookup and Push (dataport.py); 0: none."""
        return pb.DataPortResponse(port=self.data_port)

    def GetPlacement(  # noqa: N802
        self, request: pb.StatsRequest, context: grpc.ServicerContext
    ) -> pb.PlacementResponse:
        """The map and addresses this server routes by (none before its first SetMap)."""
        with self._gate:
            placement = self._placement
        if placement is None:
            return pb.PlacementResponse()
        return pb.PlacementResponse(map=placement.to_proto())

    def ExportBuckets(  # noqa: N802
        self, request: pb.BucketsRequest, context: grpc.ServicerContext
    ) -> pb.RowsMessage:
        """The rows (and optimizer state) of a table's ids in the buckets."""

        def run() -> pb.RowsMessage:
            served = self._table(request.table)
            buckets = buckets_from_bytes(request.buckets, request.num_buckets)
            with served.lock:
                ids, rows, accum = served.table.export_buckets(buckets, request.num_buckets)
                # The new owner must know which pushes these rows hold already: a push whose
                # answer was lost is retried there with the same number.
                pushes = served.applied.entries()
            return pb.RowsMessage(
                table=request.table,
                ids=ids.astype("<i8").tobytes(),
                rows=rows.astype("<f4").tobytes(),
                accum=accum.astype("<f4").tobytes(),
                dim=served.table.dim,
                seqs=pushes,
            )

        return _answer(pb.RowsMessage, run)

    def ImportRows(  # noqa: N802
        self, request: pb.RowsMessage, context: grpc.ServicerContext
    ) -> pb.ImportResponse:
        """Take rows moved from another server."""

        def run() -> pb.ImportResponse:
            served = self._table(request.table)
            ids, rows, accum = rows_from_message(request, served.table.dim)
            with served.lock:
                served.table.import_rows(ids, rows, accum)
                # The pushes applied to these rows (a replacement takes over the failed one's).
                served.applied.merge(request.seqs)
            with self._gate:
                self.moved_in += ids.size
            return pb.ImportResponse(rows=ids.size)

        return _answer(pb.ImportResponse, run)

    def DropBuckets(  # noqa: N802
        self, request: pb.BucketsRequest, context: grpc.ServicerContext
    ) -> pb.ImportResponse:
        """Forget a table's rows in the buckets (they moved away)."""

        def run() -> pb.ImportResponse:
            served = self._table(request.table)
            buckets = buckets_from_bytes(request.buckets, request.num_buckets)
            with served.lock:
                dropped = served.table.drop_buckets(buckets, request.num_buckets)
            with self._gate:
                self.moved_out += dropped
            return pb.ImportResponse(rows=dropped)

        return _answer(pb.ImportResponse, run)

    def _table(self, name: str) -> _Served:
        served = self._tables.get(name)
        if served is None:
            raise EmbeddingError(
                f"no table {name!r} on this server (it has {sorted(self._tables)}); create it "
                f"first (ElasticEmbedding does, on its first forward)"
            )
        return served

    def CreateTable(  # noqa: N802
        self, request: pb.CreateTableRequest, context: grpc.ServicerContext
    ) -> pb.CreateTableResponse:
        """Create a table; the same spec again is a no-op, another spec for the name an error."""

        def run() -> pb.CreateTableResponse:
            with self._lock:
                existing = self._tables.get(request.spec.name)
                if existing is not None:
                    if existing.spec != request.spec:
                        raise EmbeddingError(
                            f"table {request.spec.name!r} exists with another spec "
                            f"({existing.spec.dim} dims, {existing.spec.optimizer})"
                        )
                    return pb.CreateTableResponse(created=False)
                self._tables[request.spec.name] = _Served(spec_to_table(request.spec), request.spec)
                logger.info("table %r: %d dims", request.spec.name, request.spec.dim)
                return pb.CreateTableResponse(created=True)

        return _answer(pb.CreateTableResponse, run)

    def Lookup(  # noqa: N802
        self, request: pb.LookupRequest, context: grpc.ServicerContext
    ) -> pb.LookupResponse:
        """The rows of the ids, created on first use."""

        def run() -> pb.LookupResponse:
            rows, dim = self.lookup_rows(request.table, request.ids)
            return pb.LookupResponse(rows=rows.tobytes(), dim=dim)

        return _answer(pb.LookupResponse, run)

    def lookup_rows(self, table: str, ids_bytes: bytes | memoryview) -> tuple[Rows, int]:
        """(rows as little-endian float32, the table's dim) of the ids in ``ids_bytes``;
        EmbeddingError (NotOwnerError, MovingError among them) when it cannot serve them."""
        served = self._table(table)
        ids = ids_from_bytes(ids_bytes)
        version = self._enter(ids)
        try:
            with served.lock:
                rows = served.table.lookup(ids)
                served.lookups += ids.size
        finally:
            self._leave(version)
        return rows.astype("<f4", copy=False), served.table.dim

    def Push(  # noqa: N802
        self, request: pb.PushRequest, context: grpc.ServicerContext
    ) -> pb.PushResponse:
        """Apply the table's optimizer with the gradients of the ids' rows."""
        return _answer(
            pb.PushResponse,
            lambda: self.apply_push(
                request.table, request.ids, request.grads, request.client, request.seq
            ),
        )

    def apply_push(
        self,
        table: str,
        ids_bytes: bytes | memoryview,
        grads_bytes: bytes | memoryview,
        client: str,
        seq: int,
    ) -> pb.PushResponse:
        """Apply push ``seq`` of ``client`` (the gradients, little-endian float32, of the ids'
        rows) unless it was applied already; EmbeddingError when it cannot be."""
        served = self._table(table)
        ids = ids_from_bytes(ids_bytes)
        dim = served.table.dim
        if len(grads_bytes) != ids.size * dim * 4:
            raise EmbeddingError(
                f"table {table!r}: {ids.size} ids need {ids.size * dim} float32 "
                f"gradients, got {len(grads_bytes) // 4}"
            )
        grads = np.frombuffer(grads_bytes, dtype="<f4").reshape(ids.size, dim)
        version = self._enter(ids)
        try:
            with served.lock:
                if client and served.applied.applied(client, seq):
                    return pb.PushResponse(duplicate=True)
                updated = served.table.apply_gradients(ids, grads)
                served.pushes += ids.size
                if client:
                    served.applied.add(client, seq)
                self._replicate(served, updated, [(client, seq)] if client else [])
        finally:
            self._leave(version)
        return pb.PushResponse(applied=ids.size)

    def _replicate(
        self, served: _Served, unique: np.ndarray[Any, np.dtype[np.int64]], pushes: list[Claim]
    ) -> None:
        """After an update (by ``pushes``) of the rows of ``unique`` (distinct ids), under the
        table's lock: SYNC sends the rows' new values now, ASYNC marks them for the sender's
        thread. Either way the replica hears of a push together with the rows it changed, and
        of no push without them."""
        sender = self._sender
        if sender is None:
            return
        if sender.mode == pb.ASYNC:
            sender.mark(served.table.name, unique, pushes)
            return
        behind = sender.take_marked(served.table.name)  # rows an earlier send failed to carry
        if behind is not None:
            earlier, earlier_pushes = behind
            unique = np.union1d(unique, earlier[served.table.holds(earlier)])
            pushes = pushes + earlier_pushes
        rows, accum = served.table.snapshot(unique)
        try:
            sender.send(rows_message(served.spec, unique, rows, accum, claims(pushes)))
        except EmbeddingError as e:
            # Serve on: the replica is unreachable. Its rows (and their pushes) go with the
            # next update of the table that reaches it (or the resync when the next server is
            # replaced).
            sender.failures += 1
            sender.mark(served.table.name, unique, pushes)
            logger.warning("update not replicated (re-sent with the next one): %s", e)

    def Stats(  # noqa: N802
        self, request: pb.StatsRequest, context: grpc.ServicerContext
    ) -> pb.StatsResponse:
        """Rows, memory and traffic of every table."""
        with self._lock:
            served = list(self._tables.values())
        with self._gate:
            version = self._placement.map.version if self._placement is not None else 0
            moved_in, moved_out = self.moved_in, self.moved_out
        return pb.StatsResponse(
            tables=[
                pb.TableStats(
                    name=s.table.name,
                    rows=len(s.table),
                    bytes=s.table.nbytes,
                    lookups=s.lookups,
                    pushes=s.pushes,
                    spec=s.spec,
                )
                for s in served
            ],
            map_version=version,
            rows_moved_in=moved_in,
            rows_moved_out=moved_out,
            cpu_percent=self._process.cpu_percent(None),
            memory_bytes=self._process.memory_info().rss,
            pid=self._process.pid,
        )


def _answer(response: Callable[..., R], fn: Callable[[], R]) -> R:
    try:
        return fn()
    except EmbeddingError as e:
        return response(error=error_to_proto(e))


def _parsing_handlers(service: EmbeddingService) -> grpc.GenericRpcHandler:
    """The service's handlers, each parsing its own request: gRPC answers a request it cannot
    parse with a bare INTERNAL status, and a malformed request is the caller's error, to be
    named as such (INVALID_ARGUMENT)."""
    descriptor = pb.DESCRIPTOR.services_by_name["EmbeddingServer"]
    handlers = {
        method.name: grpc.unary_unary_rpc_method_handler(
            _parsing(getattr(pb, method.input_type.name), getattr(service, method.name)),
            response_serializer=getattr(pb, method.output_type.name).SerializeToString,
        )
        for method in descriptor.methods
    }
    # The hot path reads and writes its arrays without copies (frames.py); same bytes.
    handlers["Lookup"] = grpc.unary_unary_rpc_method_handler(
        _raw_handler(service, "LookupRequest", lookup_answer)
    )
    handlers["Push"] = grpc.unary_unary_rpc_method_handler(
        _raw_handler(service, "PushRequest", push_answer)
    )
    handlers["Replicate"] = grpc.unary_unary_rpc_method_handler(
        _raw_handler(service, "RowsMessage", replicate_answer)
    )
    return grpc.method_handlers_generic_handler(descriptor.full_name, handlers)


def lookup_answer(service: EmbeddingService, raw: bytes | memoryview) -> list[bytes | memoryview]:
    """The LookupResponse to the LookupRequest in ``raw`` (over gRPC or the data port), in
    pieces (frames.join makes one message of them); MalformedMessage if it is none."""
    table, ids = frames.read_lookup_request(raw)
    try:
        rows, dim = service.lookup_rows(table, ids)
    except EmbeddingError as e:
        return [pb.LookupResponse(error=error_to_proto(e)).SerializeToString()]
    return frames.lookup_response(rows, dim)


def push_answer(service: EmbeddingService, raw: bytes | memoryview) -> list[bytes | memoryview]:
    """The PushResponse to the PushRequest in ``raw``; MalformedMessage if it is none."""
    push = frames.read_push_request(raw)
    response = _answer(
        pb.PushResponse,
        lambda: service.apply_push(push.table, push.ids, push.grads, push.client, push.seq),
    )
    return [response.SerializeToString()]


def replicate_answer(
    service: EmbeddingService, raw: bytes | memoryview
) -> list[bytes | memoryview]:
    """The ImportResponse to the Replicate request (a RowsMessage) in ``raw``, its arrays read
    in place; MalformedMessage if it is none."""
    message, ids, rows, accum = frames.read_rows_message(raw)
    response = _answer(
        pb.ImportResponse,
        lambda: pb.ImportResponse(rows=service.replica.take_rows(message, ids, rows, accum)),
    )
    return [response.SerializeToString()]


def _raw_handler(
    service: EmbeddingService,
    kind: str,
    answer: Callable[[EmbeddingService, bytes], list[bytes | memoryview]],
) -> Callable[[bytes, grpc.ServicerContext], bytes]:
    def handle(raw: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            return frames.join(answer(service, raw))
        except frames.MalformedMessage as e:
            _malformed(context, kind, raw, e)

    return handle


def _malformed(context: grpc.ServicerContext, kind: str, raw: bytes, error: Exception) -> NoReturn:
    context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"malformed {kind} ({len(raw)} bytes): {error}; send it with "
        "dlrover's EmbeddingClient of the server's version",
    )
    raise AssertionError("abort returns by raising")


def _parsing(
    request_type: type[Message], method: Callable[[Any, grpc.ServicerContext], Message]
) -> Callable[[bytes, grpc.ServicerContext], Message]:
    def handle(raw: bytes, context: grpc.ServicerContext) -> Message:
        try:
            request = request_type.FromString(raw)
        except DecodeError as e:
            _malformed(context, request_type.__name__, raw, e)
        return method(request, context)

    return handle


class _TokenCheck(grpc.ServerInterceptor):
    """Refuses every call whose metadata lacks the job token."""

    def __init__(self, token: str) -> None:
        self._token = token

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "wrong or missing job token: set DLROVER_JOB_TOKEN to the job's token",
            )

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY and secrets.compare_digest(str(value), self._token):
                return continuation(details)
        return self._deny


class EmbeddingServer:
    """One `dlrover-ps`: serves an EmbeddingService on ``host:port`` (0: a free port)."""

    def __init__(
        self, token: str, host: str = "127.0.0.1", port: int = 0, threads: int = DEFAULT_THREADS
    ) -> None:
        if threads <= RESERVED_THREADS:
            raise ValueError(f"an embedding server needs more than {RESERVED_THREADS} threads")
        self.service = EmbeddingService(token, threads)
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=threads),
            interceptors=[_TokenCheck(token)],
            options=options,
        )
        self._server.add_generic_rpc_handlers((_parsing_handlers(self.service),))
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        self.address = f"{host}:{self.port}"
        # Lookup, Push and Replicate also on a plain TCP port of the same host (dataport.py).
        self._data = DataPortServer(
            host,
            0,
            token,
            {
                LOOKUP: functools.partial(lookup_answer, self.service),
                PUSH: functools.partial(push_answer, self.service),
                REPLICATE: functools.partial(replicate_answer, self.service),
            },
        )
        self.service.data_port = self._data.port

    def start(self) -> EmbeddingServer:
        """Start serving (in gRPC's threads)."""
        self._server.start()
        self._data.start()
        logger.info(
            "embedding server listening on %s (lookups and pushes also on port %d)",
            self.address,
            self._data.port,
        )
        return self

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop serving; in-flight calls get ``grace_s`` seconds."""
        self._data.close()
        self._server.stop(grace_s).wait(grace_s + 1.0)
        self.service.close()
