"""Replicas of a server's rows on the next server of the map, for failover without a restart.

The sender side (ReplicaSender) sends the current values of changed rows, with the pushes
(client, number) that changed them, to the next server: within the push in SYNC mode (the push
is acknowledged once the replica holds it), or from a thread every ASYNC_LAG_S in ASYNC mode.
The receiving side (ReplicaStore) keeps them apart from the server's own rows until a
replacement of the sender takes them over.

Applied pushes are kept per table (one Push request is one table's): a replica holds a push as
applied only once the rows it changed are there, so a replacement neither reports a too-small
gap to the client nor drops the retry of a push it lacks as a duplicate.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from dlrover.constants import TOKEN_METADATA_KEY
from dlrover.embedding import frames
from dlrover.embedding.buckets import IdArray
from dlrover.embedding.dataport import (
    MALFORMED,
    REPLICATE,
    DataChannel,
    DataPortError,
    DataPortRefused,
)
from dlrover.embedding.table import EmbeddingError, EmbeddingTable, Rows
from dlrover.embedding.wire import MAX_MESSAGE_BYTES, chunk_ids
from dlrover.proto import embedding_pb2 as pb

logger = logging.getLogger(__name__)

ASYNC_LAG_S = 0.05
"""In ASYNC mode, changed rows reach the replica at most about this long after the update."""
SEND_TIMEOUT_S = 30.0
DATA_PORT_ASK_S = 5.0
"""Deadline of asking the next server for its data port (then gRPC for that send)."""


PUSH_WINDOW = 256
"""Pushes remembered one by one per client; older ones are covered by a floor. A client has
only a few pushes in flight at once, so one older than the window cannot still arrive."""


Claim = tuple[str, int]
"""A push: (client, number)."""


class AppliedPushes:
    """Which pushes of each client a server has applied (to one table): the numbers of the last
    PUSH_WINDOW, and a floor below which all count as applied. A floor speaks for one table
    only: a number below it may be another table's push, not applied at all. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recent: dict[str, deque[int]] = {}
        self._sets: dict[str, set[int]] = {}
        self._floor: dict[str, int] = {}

    def applied(self, client: str, seq: int) -> bool:
        """Whether ``client``'s push ``seq`` was applied here."""
        with self._lock:
            return seq <= self._floor.get(client, -1) or seq in self._sets.get(client, ())

    def add(self, client: str, seq: int) -> None:
        """Record that ``client``'s push ``seq`` was applied."""
        with self._lock:
            self._add(client, seq)

    def _add(self, client: str, seq: int) -> None:
        if seq <= self._floor.get(client, -1) or seq in self._sets.get(client, ()):
            return
        recent = self._recent.setdefault(client, deque())
        known = self._sets.setdefault(client, set())
        recent.append(seq)
        known.add(seq)
        while len(recent) > PUSH_WINDOW:
            oldest = min(recent)
            recent.remove(oldest)
            known.discard(oldest)
            self._floor[client] = max(self._floor.get(client, -1), oldest)

    def of(self, client: str) -> tuple[list[int], int]:
        """``client``'s pushes remembered one by one (sorted), and its floor."""
        with self._lock:
            return sorted(self._sets.get(client, ())), self._floor.get(client, -1)

    def clear(self) -> None:
        """Forget every push (the rows they changed are gone)."""
        with self._lock:
            self._recent.clear()
            self._sets.clear()
            self._floor.clear()

    def entries(self) -> list[pb.ClientSeq]:
        """As messages: every client's pushes remembered one by one, each with its floor (for a
        receiver that gets every row these pushes changed)."""
        with self._lock:
            return [
                pb.ClientSeq(client=c, seq=s, floor=self._floor.get(c, -1))
                for c, recent in sorted(self._recent.items())
                for s in recent
            ]

    def merge(self, entries: Any) -> None:
        """Take pushes another server applied (a replica's, or a failed server's)."""
        with self._lock:
            for entry in entries:
                self._floor[entry.client] = max(self._floor.get(entry.client, -1), entry.floor)
                known = self._sets.get(entry.client)
                if known is not None:  # drop what the floor covers now
                    floor = self._floor[entry.client]
                    for seq in [s for s in known if s <= floor]:
                        known.discard(seq)
                        self._recent[entry.client].remove(seq)
                self._add(entry.client, entry.seq)


def combined(tables: list[AppliedPushes], client: str) -> tuple[list[int], int]:
    """``client``'s pushes applied to any of ``tables`` (a server's every table), without
    counting one as applied that was not: the numbers any remembers, and the lowest floor (a
    number at or below it was a push of some table, whose floor covers it)."""
    seqs: set[int] = set()
    floor: int | None = None
    for pushes in tables:
        known, low = pushes.of(client)
        seqs.update(known)
        floor = low if floor is None else min(floor, low)
    return sorted(seqs), -1 if floor is None else floor


def claims(pushes: list[Claim]) -> list[pb.ClientSeq]:
    """Just these pushes as messages, without a floor: a replicated update carries the pushes
    whose rows it carries, and no claim on the sender's older ones."""
    return [pb.ClientSeq(client=c, seq=s, floor=-1) for c, s in sorted(set(pushes))]


def rows_from_message(message: pb.RowsMessage, dim: int) -> tuple[IdArray, Rows, Rows]:
    """The ids, rows and optimizer state a RowsMessage carries; EmbeddingError when its byte
    counts do not fit ``dim`` float32 values per id."""
    # Each field read once: every access to a bytes field of a parsed message copies it.
    return arrays_from_bytes(message.table, message.ids, message.rows, message.accum, dim)


def arrays_from_bytes(
    table: str,
    ids_bytes: bytes | memoryview,
    rows_bytes: bytes | memoryview,
    accum_bytes: bytes | memoryview,
    dim: int,
) -> tuple[IdArray, Rows, Rows]:
    """Ids (little-endian int64), rows and optimizer state (float32, ``dim`` per id) as arrays
    over the bytes given (not copied); EmbeddingError when the byte counts do not fit."""
    if len(ids_bytes) % 8:
        raise EmbeddingError(f"ids must be int64: got {len(ids_bytes)} bytes")
    need = len(ids_bytes) // 8 * dim * 4
    if len(rows_bytes) != need or len(accum_bytes) != need:
        raise EmbeddingError(
            f"table {table!r}: {len(ids_bytes) // 8} rows of {dim} float32 values are "
            f"{need} bytes; got {len(rows_bytes)} of rows, {len(accum_bytes)} of state"
        )
    ids = np.frombuffer(ids_bytes, dtype="<i8").astype(np.int64, copy=False)
    rows = np.frombuffer(rows_bytes, dtype="<f4").reshape(ids.size, dim)
    accum = np.frombuffer(accum_bytes, dtype="<f4").reshape(ids.size, dim)
    return ids, rows, accum


def rows_message(
    spec: pb.TableSpec,
    ids: IdArray,
    rows: Rows,
    accum: Rows,
    seqs: list[pb.ClientSeq],
    reset: bool = False,
) -> list[bytes | memoryview]:
    """Rows (and optimizer state) of a table with the clients' pushes applied to them, as the
    pieces of a RowsMessage (frames.py: the arrays are not copied into a message first; join
    them and parse for the message itself)."""
    meta = pb.RowsMessage(table=spec.name, dim=spec.dim, seqs=seqs, spec=spec, reset=reset)
    return frames.rows_message(
        meta,
        np.ascontiguousarray(ids, dtype="<i8"),
        np.ascontiguousarray(rows, dtype="<f4"),
        np.ascontiguousarray(accum, dtype="<f4"),
    )


class ReplicaStore:
    """The replica this server holds of the previous server's tables."""

    def __init__(self, make_table: Callable[[pb.TableSpec], EmbeddingTable]) -> None:
        self._make_table = make_table
        self._lock = threading.Lock()
        self.tables: dict[str, EmbeddingTable] = {}
        self.pushes: dict[str, AppliedPushes] = {}
        """Per table, the pushes whose rows this replica holds."""
        self.heard_at: float | None = None

    def take(self, message: pb.RowsMessage) -> int:
        """Apply a Replicate message; returns the rows it carried."""
        return self.take_rows(message, message.ids, message.rows, message.accum)

    def take_rows(
        self,
        message: pb.RowsMessage,
        ids_bytes: bytes | memoryview,
        rows_bytes: bytes | memoryview,
        accum_bytes: bytes | memoryview,
    ) -> int:
        """Apply a Replicate message whose arrays come apart from it (``message``'s own are
        not read); returns the rows it carried."""
        with self._lock:
            if message.reset:  # a full resend: what the sender had applied comes with it
                self.tables.pop(message.table, None)
                self.pushes.pop(message.table, None)
            table = self.tables.get(message.table)
            if table is None:
                table = self.tables[message.table] = self._make_table(message.spec)
            ids, rows, accum = arrays_from_bytes(
                message.table, ids_bytes, rows_bytes, accum_bytes, table.dim
            )
            if ids.size:
                table.import_rows(ids, rows, accum)
            self.pushes.setdefault(message.table, AppliedPushes()).merge(message.seqs)
            self.heard_at = time.monotonic()
            return int(ids.size)

    def export(self, name: str, buckets: IdArray, num_buckets: int) -> pb.RowsMessage:
        """The replica's rows of ``name`` in ``buckets``, the pushes applied to them and age."""
        with self._lock:
            table = self.tables.get(name)
            pushes = self.pushes.get(name)
            seqs = pushes.entries() if pushes is not None else []
            if table is None:
                # Nothing of it changed on the previous server (or it was lookup-only): its
                # rows come back as they started, from the table's seed and the id.
                none = np.empty((0, 0), dtype=np.float32)
                message = _parsed(rows_message(
                    pb.TableSpec(name=name), np.empty(0, dtype=np.int64), none, none, seqs
                ))  # fmt: skip
                message.age_s = (
                    time.monotonic() - self.heard_at if self.heard_at is not None else -1.0
                )
                return message
            ids, rows, accum = table.export_buckets(buckets, num_buckets)
            spec = pb.TableSpec(name=name, dim=table.dim)
            message = _parsed(rows_message(spec, ids, rows, accum, seqs))
            age = time.monotonic() - self.heard_at if self.heard_at is not None else -1.0
            message.age_s = age
            return message


def _parsed(pieces: list[bytes | memoryview]) -> pb.RowsMessage:
    return pb.RowsMessage.FromString(frames.join(pieces))


class ReplicaSender:
    """Sends this server's changed rows to the next server (``address``) in ``mode``."""

    def __init__(self, address: str, token: str, mode: int) -> None:
        self.address = address
        self.mode = mode
        options = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
        self._channel = grpc.insecure_channel(address, options=options)
        service = pb.DESCRIPTOR.services_by_name["EmbeddingServer"].full_name
        self._replicate = self._channel.unary_unary(f"/{service}/Replicate")
        self._data_port = self._channel.unary_unary(
            f"/{service}/DataPort",
            request_serializer=pb.StatsRequest.SerializeToString,
            response_deserializer=pb.DataPortResponse.FromString,
        )
        self._metadata = ((TOKEN_METADATA_KEY, token),)
        self._token = token
        self._data: DataChannel | None = None
        """The next server's data port, once asked for and reached (None: gRPC)."""
        self._data_asked = False
        self._data_lock = threading.Lock()
        self._dirty: dict[str, list[IdArray]] = {}
        self._claims: dict[str, list[Claim]] = {}
        """Per table, the pushes that changed the marked rows (not on the replica yet)."""
        self._dirty_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failures = 0

    def send(self, request: list[bytes | memoryview]) -> None:
        """One Replicate call with the pieces ``rows_message`` made (over the next server's
        data port, else gRPC); EmbeddingError when the next server does not take it."""
        channel = self._data_channel()
        if channel is not None:
            try:
                with channel.request(REPLICATE, request, SEND_TIMEOUT_S) as raw:
                    answer = bytes(raw)
                return self._check(answer)
            except DataPortRefused as e:
                if e.status != MALFORMED:
                    self._forget(channel, again=True)
                    raise EmbeddingError(f"the replica at {self.address} refused: {e}") from None
                # A server of an earlier release: its data port takes no Replicate.
                self._forget(channel, again=False)
            except DataPortError as e:
                self._forget(channel, again=True)
                raise EmbeddingError(f"the replica at {self.address} did not answer: {e}") from None
        try:
            raw = self._replicate(
                frames.join(request), timeout=SEND_TIMEOUT_S, metadata=self._metadata
            )
        except grpc.RpcError as e:
            raise EmbeddingError(f"the replica at {self.address} did not answer: {e}") from None
        self._check(raw)

    def _check(self, raw: bytes) -> None:
        try:
            response = pb.ImportResponse.FromString(raw)
        except DecodeError as e:
            raise EmbeddingError(f"the replica at {self.address} answered garbage: {e}") from None
        if response.HasField("error"):
            raise EmbeddingError(f"the replica at {self.address}: {response.error.message}")

    def _forget(self, channel: DataChannel, again: bool) -> None:
        """Stop using ``channel``: ask for the port again at the next send if ``again``, else
        send over gRPC from now on."""
        with self._data_lock:
            if self._data is channel:
                self._data, self._data_asked = None, not again
        channel.close()

    def _data_channel(self) -> DataChannel | None:
        """The next server's data port, asked for when first needed (and again after a send
        over it failed, or the ask itself did); None: this send goes over gRPC (for good when
        the server has no data port or it cannot be reached)."""
        with self._data_lock:
            if self._data is not None or self._data_asked:
                return self._data
            try:
                port = self._data_port(
                    pb.StatsRequest(), timeout=DATA_PORT_ASK_S, metadata=self._metadata
                ).port
            except grpc.RpcError as e:
                if isinstance(e, grpc.Call) and e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self._data_asked = True  # an earlier release: gRPC for good
                return None  # else gRPC this time, whose own call says what is wrong
            self._data_asked = True
            if not port:
                return None
            channel = DataChannel(self.address.rsplit(":", 1)[0].strip("[]"), port, self._token)
            try:
                channel.connect()
            except DataPortError as e:
                logger.warning(
                    "the replica at %s: its data port %d cannot be reached (%s): replicas go "
                    "over gRPC",
                    self.address,
                    port,
                    e,
                )
                return None
            self._data = channel
            return channel

    def send_all(self, spec: pb.TableSpec, table: EmbeddingTable, seqs: list[pb.ClientSeq]) -> int:
        """Resend a whole table (the replica drops what it held first, rows and pushes);
        returns rows sent. ``seqs`` (the pushes applied to the table) go with the last piece:
        a resend cut short leaves the replica claiming none of them."""
        ids, rows, accum = table.export_all()
        step = chunk_ids(spec.dim)
        starts = range(0, max(ids.size, 1), step)
        for start in starts:
            part = slice(start, start + step)
            last = start == starts[-1]
            self.send(
                rows_message(
                    spec, ids[part], rows[part], accum[part], seqs if last else [], start == 0
                )
            )
        return int(ids.size)

    def mark(self, table: str, ids: IdArray, pushes: Sequence[Claim] = ()) -> None:
        """``ids`` of ``table`` changed (by ``pushes``) and are not on the replica yet: ASYNC's
        thread sends their values soon; in SYNC mode (a send that failed) the next update of
        the table takes them along (`take_marked`). Call it under the table's lock, after the
        update: the marked rows then hold every marked push."""
        with self._dirty_lock:
            self._dirty.setdefault(table, []).append(ids)
            self._claims.setdefault(table, []).extend(pushes)

    def take_marked(self, table: str) -> tuple[IdArray, list[Claim]] | None:
        """The ids of ``table`` marked (None if none) and the pushes that changed them, now
        unmarked. Under the table's lock, the rows' values then hold exactly those pushes and
        the ones sent before: a message with both claims only pushes whose rows it carries."""
        with self._dirty_lock:
            parts = self._dirty.pop(table, None)
            pushes = self._claims.pop(table, [])
        return (np.unique(np.concatenate(parts)), pushes) if parts else None

    def marked(self) -> list[str]:
        """The tables with marked rows."""
        with self._dirty_lock:
            return [t for t, parts in self._dirty.items() if parts]

    def start(self, flush: Callable[[list[str]], None]) -> None:
        """ASYNC: start the thread that hands the tables with marked rows to ``flush`` every
        ASYNC_LAG_S (which takes them with `take_marked`, and marks again what it could not
        send: the next round resends the newer values)."""

        def run() -> None:
            while not self._stop.wait(ASYNC_LAG_S):
                tables = self.marked()
                if not tables:
                    continue
                try:
                    flush(tables)
                except EmbeddingError as e:
                    self.failures += 1
                    logger.warning("replication to %s failed: %s", self.address, e)

        self._thread = threading.Thread(target=run, name="embedding-replica", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread and close the channels."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(SEND_TIMEOUT_S)
        self._channel.close()
        with self._data_lock:
            data, self._data = self._data, None
        if data is not None:
            data.close()
