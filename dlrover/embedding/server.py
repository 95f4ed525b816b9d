"""The embedding server (`dlrover-ps`): sparse tables behind gRPC, numpy arrays on the wire."""

from __future__ import annotations

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

from dlrover.api.rpc import Rpc
from dlrover.constants import TOKEN_METADATA_KEY
from dlrover.embedding import frames
from dlrover.embedding.api import RPCS, SERVICE, EmbeddingServerApi
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
)
from dlrover.proto import embedding_pb2 as pb

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


class EmbeddingService(EmbeddingServerApi):
    """The tables of one server, each behind its own lock (lookups of different tables run in
    parallel; numpy releases the GIL in its large copies). It implements `EmbeddingServerApi`:
    its methods raise EmbeddingError to refuse, and the handlers derived from the interface
    (`_handlers`) put that in the answer."""

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

    def set_map(
        self, map: pb.BucketMapMessage, index: int = 0, frozen: bytes = b"", replica: int = 0
    ) -> None:
        """Take a newer map (and the buckets to refuse while they move); returns once no request
        admitted under the old one is still running."""
        placement = Placement.from_proto(map)
        new = placement.map
        frozen_buckets = buckets_from_bytes(frozen, new.num_buckets)
        if not -1 <= index < len(placement.addresses):
            raise EmbeddingError(
                f"server index {index} is not in the map's "
                f"{len(placement.addresses)} servers (-1: removed)"
            )
        if replica not in pb.ReplicaMode.values():
            raise EmbeddingError(
                f"unknown replica mode {replica} (known: "
                f"{', '.join(pb.ReplicaMode.keys())}): is the server older than the master?"
            )
        with self._gate:
            old = self._placement
            if old is not None and new.version < old.map.version:
                raise EmbeddingError(
                    f"map version {new.version} is older than this server's {old.map.version}"
                )
            self._placement, self._index = placement, index
            retired = self._replicate_to(placement, index, replica)
            self._owned = np.asarray(new.owners) == index
            self._frozen = np.zeros(new.num_buckets, dtype=bool)
            self._frozen[frozen_buckets] = True

            def old_ones_done() -> bool:
                return all(v >= new.version for v in self._active)

            done = self._gate.wait_for(old_ones_done, timeout=60.0)
        if retired is not None:
            retired.close()  # outside the gate: its thread may take a while to stop
        if not done:
            raise EmbeddingError("requests under the old map did not end within 60s")

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

    def replicate(self, rows: pb.RowsMessage) -> int:
        """Hold rows of the previous server (its replica)."""
        return self.replica.take(rows)

    def replicate_frames(self, raw: bytes | memoryview) -> list[bytes | memoryview]:
        """`replicate` of the RowsMessage in ``raw``, its arrays read in place; the answer's
        bytes. MalformedMessage if ``raw`` is none."""
        message, ids, rows, accum = frames.read_rows_message(raw)
        return _answered(
            "replicate",
            lambda: pb.ImportResponse(rows=self.replica.take_rows(message, ids, rows, accum)),
        )

    def export_replica(self, table: str, buckets: bytes, num_buckets: int) -> pb.RowsMessage:
        """The replica's rows of a table in the buckets (to restore a replacement)."""
        return self.replica.export(table, buckets_from_bytes(buckets, num_buckets), num_buckets)

    def resync_replica(self) -> int:
        """Send every row to the next server, which drops what it held of this one first."""
        sender = self._sender
        if sender is None:
            return 0
        with self._lock:
            served = list(self._tables.values())
        sent = 0
        for entry in served:
            with entry.lock:
                sent += sender.send_all(entry.spec, entry.table, entry.applied.entries())
        return sent

    def applied_pushes(self, client: str, table: str = "") -> pb.AppliedPushesResponse:
        """The client's pushes this server holds as applied to the table (to any table, counting
        none that was not, when no table is named)."""
        with self._lock:
            served = list(self._tables.values())
        if table:
            served = [s for s in served if s.table.name == table]
            if not served:
                return pb.AppliedPushesResponse(seqs=[], floor=-1)
        seqs, floor = combined([s.applied for s in served], client)
        return pb.AppliedPushesResponse(seqs=seqs, floor=floor)

    def get_data_port(self) -> int:
        """The TCP port that also takes Lookup and Push (dataport.py); 0: none."""
        return self.data_port

    def get_placement(self) -> pb.BucketMapMessage | None:
        """The map and addresses this server routes by (None before its first set_map)."""
        with self._gate:
            placement = self._placement
        return None if placement is None else placement.to_proto()

    def export_buckets(self, table: str, buckets: bytes, num_buckets: int) -> pb.RowsMessage:
        """The rows (and optimizer state) of a table's ids in the buckets."""
        served = self._table(table)
        wanted = buckets_from_bytes(buckets, num_buckets)
        with served.lock:
            ids, rows, accum = served.table.export_buckets(wanted, num_buckets)
            # The new owner must know which pushes these rows hold already: a push whose
            # answer was lost is retried there with the same number.
            pushes = served.applied.entries()
        return pb.RowsMessage(
            table=table,
            ids=ids.astype("<i8").tobytes(),
            rows=rows.astype("<f4").tobytes(),
            accum=accum.astype("<f4").tobytes(),
            dim=served.table.dim,
            seqs=pushes,
        )

    def import_rows(self, rows: pb.RowsMessage) -> int:
        """Take rows moved from another server."""
        served = self._table(rows.table)
        ids, values, accum = rows_from_message(rows, served.table.dim)
        with served.lock:
            served.table.import_rows(ids, values, accum)
            # The pushes applied to these rows (a replacement takes over the failed one's).
            served.applied.merge(rows.seqs)
        with self._gate:
            self.moved_in += ids.size
        return int(ids.size)

    def drop_buckets(self, table: str, buckets: bytes, num_buckets: int) -> int:
        """Forget a table's rows in the buckets (they moved away)."""
        served = self._table(table)
        wanted = buckets_from_bytes(buckets, num_buckets)
        with served.lock:
            dropped = served.table.drop_buckets(wanted, num_buckets)
        with self._gate:
            self.moved_out += dropped
        return dropped

    def _table(self, name: str) -> _Served:
        served = self._tables.get(name)
        if served is None:
            raise EmbeddingError(
                f"no table {name!r} on this server (it has {sorted(self._tables)}); create it "
                f"first (ElasticEmbedding does, on its first forward)"
            )
        return served

    def create_table(self, spec: pb.TableSpec) -> bool:
        """Create a table; the same spec again is a no-op, another spec for the name an error."""
        with self._lock:
            existing = self._tables.get(spec.name)
            if existing is not None:
                if existing.spec != spec:
                    raise EmbeddingError(
                        f"table {spec.name!r} exists with another spec "
                        f"({existing.spec.dim} dims, {existing.spec.optimizer})"
                    )
                return False
            self._tables[spec.name] = _Served(spec_to_table(spec), spec)
            logger.info("table %r: %d dims", spec.name, spec.dim)
            return True

    def lookup(self, table: str, ids: bytes) -> pb.LookupResponse:
        """The rows of the ids, created on first use."""
        rows, dim = self.lookup_rows(table, ids)
        return pb.LookupResponse(rows=rows.tobytes(), dim=dim)

    def lookup_frames(self, raw: bytes | memoryview) -> list[bytes | memoryview]:
        """`lookup` of the LookupRequest in ``raw`` (over gRPC or the data port), answered in
        pieces (frames.join makes one message of them); MalformedMessage if ``raw`` is none."""
        table, ids = frames.read_lookup_request(raw)
        try:
            rows, dim = self.lookup_rows(table, ids)
        except EmbeddingError as e:
            return [_refused("lookup", e)]
        return frames.lookup_response(rows, dim)

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

    def push(
        self, table: str, ids: bytes, grads: bytes, client: str = "", seq: int = 0
    ) -> pb.PushResponse:
        """Apply the table's optimizer with the gradients of the ids' rows."""
        return self.apply_push(table, ids, grads, client, seq)

    def push_frames(self, raw: bytes | memoryview) -> list[bytes | memoryview]:
        """`push` of the PushRequest in ``raw``, its arrays read in place; the answer's bytes.
        MalformedMessage if ``raw`` is none."""
        push = frames.read_push_request(raw)
        return _answered(
            "push",
            lambda: self.apply_push(push.table, push.ids, push.grads, push.client, push.seq),
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

    def stats(self) -> pb.StatsResponse:
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


def _refused(method: str, error: EmbeddingError) -> bytes:
    """The bytes of ``method``'s answer that refuses with ``error``."""
    return RPCS[method].refusal(error).SerializeToString()  # type: ignore[no-any-return]


def _answered(method: str, answer: Callable[[], Message]) -> list[bytes | memoryview]:
    """The bytes of ``method``'s answer, or of its refusal when ``answer`` raises one."""
    try:
        return [answer().SerializeToString()]
    except EmbeddingError as e:
        return [_refused(method, e)]


def _handlers(service: EmbeddingService) -> grpc.GenericRpcHandler:
    """The server's handlers, derived from `EmbeddingServerApi` (`RPCS`): each parses its own
    request (gRPC answers a request it cannot parse with a bare INTERNAL status, and a malformed
    request is the caller's error, to be named as such: INVALID_ARGUMENT), runs the service's
    method and answers; an EmbeddingError raised is the answer's refusal. A framed call hands
    the request's bytes to the service's ``<method>_frames``."""
    handlers = {
        call.name: grpc.unary_unary_rpc_method_handler(
            _framed(call, getattr(service, f"{call.method}_frames"))
            if call.options.framed
            else _handler(call, getattr(service, call.method))
        )
        for call in RPCS.values()
    }
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)


def _handler(
    call: Rpc, method: Callable[..., Any]
) -> Callable[[bytes, grpc.ServicerContext], bytes]:
    def handle(raw: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            request = call.request_type.FromString(raw)
        except DecodeError as e:
            _malformed(context, call.request_type.__name__, raw, e)
        try:
            try:
                args = call.decode_request(request)
            except ValueError as e:  # a message field the call needs is missing
                raise EmbeddingError(str(e)) from None
            response = call.encode_response(method(**args))
        except EmbeddingError as e:
            response = call.refusal(e)
        return response.SerializeToString()  # type: ignore[no-any-return]

    return handle


def _framed(
    call: Rpc, answer: Callable[[bytes | memoryview], list[bytes | memoryview]]
) -> Callable[[bytes, grpc.ServicerContext], bytes]:
    def handle(raw: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            return frames.join(answer(raw))
        except frames.MalformedMessage as e:
            _malformed(context, call.request_type.__name__, raw, e)

    return handle


def _malformed(context: grpc.ServicerContext, kind: str, raw: bytes, error: Exception) -> NoReturn:
    context.abort(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"malformed {kind} ({len(raw)} bytes): {error}; send it with "
        "dlrover's EmbeddingClient of the server's version",
    )
    raise AssertionError("abort returns by raising")


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
        self._server.add_generic_rpc_handlers((_handlers(self.service),))
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
                LOOKUP: self.service.lookup_frames,
                PUSH: self.service.push_frames,
                REPLICATE: self.service.replicate_frames,
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
