"""The hot path's messages (Lookup and Push) read and written without copying their arrays.

They are the protobuf messages of embedding.proto, byte for byte: a client or server that uses
the generated classes reads and writes the same bytes. What differs is the copies. Building a
``PushRequest`` from 2 MiB of gradients copied them three times (``tobytes``, the message, its
serialisation) and reading a ``LookupResponse``'s rows twice (the parse, the field access), each
into fresh memory; here an array is copied once, straight into the bytes that go on the wire,
and an array received is a view of the bytes that came off it. Only the fields these messages
need are handled: a varint (wire type 0) and a length-delimited field (wire type 2); fixed-width
fields are skipped and anything else is refused as malformed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from dlrover.proto import embedding_pb2 as pb

VARINT = 0
FIXED64 = 1
LENGTH_DELIMITED = 2
FIXED32 = 5

Field = int | memoryview


class MalformedMessage(ValueError):
    """Bytes that are not a protobuf message of the kind these functions read."""


def varint(value: int) -> bytes:
    """``value`` as a protobuf varint (a negative int64 as its 64-bit two's complement)."""
    value &= (1 << 64) - 1
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def key(number: int, wire_type: int) -> bytes:
    """The key that precedes field ``number`` of ``wire_type``."""
    return varint(number << 3 | wire_type)


def length_prefix(number: int, nbytes: int) -> bytes:
    """The key and length of a length-delimited field ``number`` of ``nbytes`` bytes; the bytes
    follow it on the wire."""
    return key(number, LENGTH_DELIMITED) + varint(nbytes)


def join(parts: Sequence[bytes | memoryview]) -> bytes:
    """One bytes object of ``parts``: the single copy of each."""
    return b"".join(parts)


def fields(data: bytes | memoryview) -> dict[int, Field]:
    """Field number -> value of the message in ``data``: an int for a varint, a view into
    ``data`` for a length-delimited field (no copy); the last occurrence wins, as protobuf's
    for a singular field. MalformedMessage for truncated or foreign bytes."""
    return {number: value for number, value, _ in _walk(data) if value is not None}


def split(data: bytes | memoryview, big: set[int]) -> tuple[bytes, dict[int, memoryview]]:
    """The message in ``data`` without its length-delimited fields ``big`` (the rest's bytes as
    they came, for the generated class to parse), and views of those fields (the last of
    each). MalformedMessage as ``fields``."""
    rest: list[memoryview] = []
    found: dict[int, memoryview] = {}
    for number, value, span in _walk(data):
        if number in big and isinstance(value, memoryview):
            found[number] = value
        else:
            rest.append(span)
    return join(rest), found


def _walk(data: bytes | memoryview) -> Iterator[tuple[int, Field | None, memoryview]]:
    """(number, value, the field's bytes) of each field of the message in ``data``; the value
    is None for a fixed-width field."""
    view = memoryview(data).cast("B")
    pos, end = 0, len(view)
    while pos < end:
        start = pos
        tag, pos = _read_varint(view, pos)
        number, wire_type = tag >> 3, tag & 7
        value: Field | None = None
        if number == 0:
            raise MalformedMessage("field number 0")
        if wire_type == VARINT:
            value, pos = _read_varint(view, pos)
        elif wire_type == LENGTH_DELIMITED:
            size, pos = _read_varint(view, pos)
            if pos + size > end:
                raise MalformedMessage(f"field {number} runs {pos + size - end} bytes past the end")
            value = view[pos : pos + size]
            pos += size
        elif wire_type in (FIXED64, FIXED32):
            pos += 8 if wire_type == FIXED64 else 4
            if pos > end:
                raise MalformedMessage(f"field {number} runs past the end")
        else:
            raise MalformedMessage(f"field {number} has wire type {wire_type}")
        yield number, value, view[start:pos]


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(view):
            raise MalformedMessage("a varint runs past the end")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise MalformedMessage("a varint longer than 10 bytes")


def as_int(value: Field | None, signed: bool = True) -> int:
    """A varint field's value (0 when absent), as int64 if ``signed``."""
    if value is None:
        return 0
    if isinstance(value, memoryview):
        raise MalformedMessage("a varint field was sent length-delimited")
    value &= (1 << 64) - 1  # as protobuf reads a varint of more than 64 bits
    return value - (1 << 64) if signed and value >= 1 << 63 else value


def as_view(value: Field | None) -> memoryview:
    """A length-delimited field's bytes (empty when absent), not copied."""
    if value is None:
        return memoryview(b"")
    if not isinstance(value, memoryview):
        raise MalformedMessage("a bytes field was sent as a varint")
    return value


def as_str(value: Field | None) -> str:
    """A string field's text (empty when absent)."""
    try:
        return bytes(as_view(value)).decode()
    except UnicodeDecodeError as e:
        raise MalformedMessage(f"a string field is not UTF-8: {e}") from None


def _number(message: Any, name: str) -> int:
    return int(message.DESCRIPTOR.fields_by_name[name].number)


# The field numbers, from the generated classes (embedding.proto is the one definition).
_LOOKUP_TABLE = _number(pb.LookupRequest, "table")
_LOOKUP_IDS = _number(pb.LookupRequest, "ids")
_ROWS_ERROR = _number(pb.LookupResponse, "error")
_ROWS = _number(pb.LookupResponse, "rows")
_ROWS_DIM = _number(pb.LookupResponse, "dim")
_PUSH_TABLE = _number(pb.PushRequest, "table")
_PUSH_IDS = _number(pb.PushRequest, "ids")
_PUSH_GRADS = _number(pb.PushRequest, "grads")
_PUSH_CLIENT = _number(pb.PushRequest, "client")
_PUSH_SEQ = _number(pb.PushRequest, "seq")
_RM_IDS = _number(pb.RowsMessage, "ids")
_RM_ROWS = _number(pb.RowsMessage, "rows")
_RM_ACCUM = _number(pb.RowsMessage, "accum")


def _text(number: int, text: str) -> bytes:
    data = text.encode()
    return length_prefix(number, len(data)) + data if data else b""


def _array(number: int, array: np.ndarray[Any, Any]) -> list[bytes | memoryview]:
    """Field ``number`` holding the bytes of ``array`` (C-contiguous), not copied yet."""
    if not array.nbytes:
        return []
    return [length_prefix(number, array.nbytes), array.data.cast("B")]


def lookup_request(table: str, ids: np.ndarray[Any, Any]) -> list[bytes | memoryview]:
    """A LookupRequest of ``ids`` (C-contiguous little-endian int64), in pieces that ``join``
    makes one message of (or a socket sends one after the other): ids are not copied yet."""
    return [_text(_LOOKUP_TABLE, table), *_array(_LOOKUP_IDS, ids)]


def read_lookup_request(data: bytes | memoryview) -> tuple[str, memoryview]:
    """(table, ids' bytes) of a LookupRequest."""
    got = fields(data)
    return as_str(got.get(_LOOKUP_TABLE)), as_view(got.get(_LOOKUP_IDS))


def lookup_response(rows: np.ndarray[Any, Any], dim: int) -> list[bytes | memoryview]:
    """A LookupResponse carrying ``rows`` (C-contiguous little-endian float32), in pieces as
    ``lookup_request``'s."""
    return [*_array(_ROWS, rows), key(_ROWS_DIM, VARINT) + varint(dim)]


@dataclass(frozen=True)
class LookupAnswer:
    """A LookupResponse read: the refusal, or the rows' bytes (a view) and their width."""

    error: pb.EmbeddingError | None
    rows: memoryview
    dim: int


def read_lookup_response(data: bytes | memoryview) -> LookupAnswer:
    """A LookupResponse: a refusal is parsed whole (it is small and rare)."""
    got = fields(data)
    if _ROWS_ERROR in got:
        return LookupAnswer(pb.LookupResponse.FromString(bytes(data)).error, memoryview(b""), 0)
    return LookupAnswer(None, as_view(got.get(_ROWS)), as_int(got.get(_ROWS_DIM)))


@dataclass(frozen=True)
class PushFields:
    """A PushRequest read; ``ids`` and ``grads`` are views of the bytes received."""

    table: str
    ids: memoryview
    grads: memoryview
    client: str
    seq: int


def push_request(
    table: str, ids: np.ndarray[Any, Any], grads: np.ndarray[Any, Any], client: str, seq: int
) -> list[bytes | memoryview]:
    """A PushRequest of ``ids`` (int64) and their ``grads`` (float32), both C-contiguous and
    little-endian, in pieces as ``lookup_request``'s."""
    return [
        _text(_PUSH_TABLE, table),
        *_array(_PUSH_IDS, ids),
        *_array(_PUSH_GRADS, grads),
        _text(_PUSH_CLIENT, client),
        key(_PUSH_SEQ, VARINT) + varint(seq) if seq else b"",
    ]


def read_push_request(data: bytes | memoryview) -> PushFields:
    """A PushRequest's fields."""
    got = fields(data)
    return PushFields(
        table=as_str(got.get(_PUSH_TABLE)),
        ids=as_view(got.get(_PUSH_IDS)),
        grads=as_view(got.get(_PUSH_GRADS)),
        client=as_str(got.get(_PUSH_CLIENT)),
        seq=as_int(got.get(_PUSH_SEQ)),
    )


def rows_message(
    meta: pb.RowsMessage,
    ids: np.ndarray[Any, Any],
    rows: np.ndarray[Any, Any],
    accum: np.ndarray[Any, Any],
) -> list[bytes | memoryview]:
    """A RowsMessage: ``meta``'s fields (no ids, rows or accum of its own) and the arrays
    (C-contiguous little-endian int64 and float32), in pieces as ``lookup_request``'s."""
    return [
        meta.SerializeToString(),
        *_array(_RM_IDS, ids),
        *_array(_RM_ROWS, rows),
        *_array(_RM_ACCUM, accum),
    ]


def read_rows_message(
    data: bytes | memoryview,
) -> tuple[pb.RowsMessage, memoryview, memoryview, memoryview]:
    """A RowsMessage as (its other fields, ids, rows, accum): the arrays are views of
    ``data``, the rest parsed by the generated class."""
    rest, arrays = split(data, {_RM_IDS, _RM_ROWS, _RM_ACCUM})
    try:
        meta = pb.RowsMessage.FromString(rest)
    except DecodeError as e:
        raise MalformedMessage(str(e)) from None
    empty = memoryview(b"")
    ids, rows, accum = (arrays.get(n, empty) for n in (_RM_IDS, _RM_ROWS, _RM_ACCUM))
    return meta, ids, rows, accum
