"""The abuse protocol_fuzz.py sends: random and mutated messages, and how an answer is judged.

Two wires: gRPC with protobuf (the master, the embedding servers) and JSON lines on a socket
(the checkpoint saver, the replica port). For each a case is made from a plausible message
(random field values, unknown enum values, extreme numbers) or from raw bytes, then mutated
(bit flips, truncation, a field dropped or repeated, a length prefix of gigabytes, an
oversized payload), and sent with the right token, a wrong one or none. An answer is one of
`OUTCOMES`.
"""

from __future__ import annotations

import json
import math
import random
import socket
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

CLEAR = "clear"
"""A refusal that names what is wrong: an error status with a message, a response's error
field, an error line from a socket server, or a socket closed on a bad message."""
ACCEPTED = "accepted"
"""A valid answer (a mutation that is still a valid request, or a valid probe)."""
UNCLEAR = "unclear"
"""An answer that says nothing useful (UNKNOWN/INTERNAL, an empty message, garbage)."""
HANG = "hang"
"""No answer within the case's deadline."""
CRASH = "crash"
"""The server's process died."""
OUTCOMES = (CLEAR, ACCEPTED, UNCLEAR, HANG, CRASH)

CASE_DEADLINE_S = 5.0
"""How long one case waits for its answer."""
OVERSIZED_BYTES = 80 << 20
"""An oversized payload: more than either gRPC server's message cap (4 MiB / 64 MiB)."""
OVERSIZED_LINE_BYTES = 4 << 20
"""An oversized JSON line (the socket servers read lines of at most 1 MiB)."""

_CLEAR_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.PERMISSION_DENIED,
}

_INTS = [0, 1, -1, 7, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63), 2**64 - 1]
_FLOATS = [0.0, -1.0, 0.5, 1e308, -1e308, math.inf, -math.inf, math.nan, 1e9]
_WAITS = [0, 0.05, -1.0, math.nan, math.inf, 1e308, 1e9, 2**63 - 1]
"""Values of a field that says how long to wait: the finite huge ones must be refused, not
waited for (the fuzzer would call that a hang)."""
EXTREME_WAITS = [math.nan, math.inf, 1e308, 1e9, 2**63 - 1]
"""Waits no server should take on: NaN, infinite, or longer than anyone means."""
_SIZES = [0, 1, 64, 4096, -1, 2**62, 2**63 - 1, 2**64, 1e300]
"""Values of a byte-count field: small, or beyond any memory. A size between is a request the
servers honour by design (a worker's checkpoint is as large as it is), so none is sent."""
_STRINGS = ["", "a", "probe", "x" * 5000, "../../etc/passwd", "\x00\x01", "é\u202e", "own/0"]
_INT_RANGE = {
    FieldDescriptor.CPPTYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.CPPTYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, 2**64 - 1),
}


# ---------------------------------------------------------------------------- protobuf
def random_message(rng: random.Random, cls: type[Message], depth: int = 0) -> Message:
    """A message of ``cls`` with random, often extreme, values in a random subset of fields."""
    message = cls()
    for field in cls.DESCRIPTOR.fields:
        if rng.random() < 0.3:
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            continue  # byte mutations reach map fields
        if field.is_repeated:
            for _ in range(rng.randint(0, 3)):
                _add(rng, message, field, depth)
        elif field.message_type is not None:
            if depth < 3:
                getattr(message, field.name).CopyFrom(random_message(rng, _cls(field), depth + 1))
        else:
            setattr(message, field.name, _scalar(rng, field))
    return message


def _cls(field: Any) -> type[Message]:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(field.message_type)  # type: ignore[arg-type]


def _add(rng: random.Random, message: Message, field: Any, depth: int) -> None:
    values = getattr(message, field.name)
    if field.message_type is not None:
        if depth < 3:
            values.add().CopyFrom(random_message(rng, _cls(field), depth + 1))
    else:
        values.append(_scalar(rng, field))


def _scalar(rng: random.Random, field: Any) -> Any:
    kind = field.cpp_type
    if _is_wait(field.name) and rng.random() < 0.5:
        value = rng.choice(_WAITS)
        if kind in _INT_RANGE:
            return int(value) if math.isfinite(value) and value < 2**31 else 2**31 - 1
        return value
    if kind in _INT_RANGE:
        low, high = _INT_RANGE[kind]
        value = rng.choice(_INTS) if rng.random() < 0.6 else rng.randint(-5, 100)
        return min(max(value, low), high)
    if kind in (FieldDescriptor.CPPTYPE_DOUBLE, FieldDescriptor.CPPTYPE_FLOAT):
        value = rng.choice(_FLOATS) if rng.random() < 0.7 else rng.uniform(-10, 10)
        if kind == FieldDescriptor.CPPTYPE_FLOAT and math.isfinite(value) and abs(value) > 3e38:
            value = math.copysign(math.inf, value)
        return value
    if kind == FieldDescriptor.CPPTYPE_BOOL:
        return rng.random() < 0.5
    if kind == FieldDescriptor.CPPTYPE_ENUM:
        known = [v.number for v in field.enum_type.values]  # type: ignore[union-attr]
        return rng.choice(known) if rng.random() < 0.5 else rng.choice([99, -1, 2**31 - 1])
    if field.type == FieldDescriptor.TYPE_BYTES:
        size = rng.choice([0, 3, 8, 16, 64, 800])
        return rng.randbytes(size)
    return rng.choice(_STRINGS)


def _is_wait(name: str) -> bool:
    return "timeout" in name or "wait" in name


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def mutate_message(rng: random.Random, message: Message) -> tuple[str, bytes]:
    """(what was done, the bytes) of a mutation of ``message``."""
    data = message.SerializeToString()
    kind = rng.choice(
        ["as_is", "bit_flips", "truncate", "drop_field", "repeat_field", "huge_length", "splice"]
    )
    if kind == "bit_flips" and data:
        raw = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        return kind, bytes(raw)
    if kind == "truncate" and data:
        return kind, data[: rng.randrange(len(data))]
    set_fields = [f for f, _ in message.ListFields()]
    if kind == "drop_field" and set_fields:
        copy = type(message)()
        copy.CopyFrom(message)
        copy.ClearField(rng.choice(set_fields).name)
        return kind, copy.SerializeToString()
    if kind == "repeat_field" and set_fields:
        only = type(message)()
        field = rng.choice(set_fields)
        if field.is_repeated:
            getattr(only, field.name).extend(getattr(message, field.name))
        elif field.message_type is not None:
            getattr(only, field.name).CopyFrom(getattr(message, field.name))
        else:
            setattr(only, field.name, getattr(message, field.name))
        return kind, data + only.SerializeToString() * rng.randint(1, 3)
    if kind == "huge_length":
        number = rng.choice([f.number for f in message.DESCRIPTOR.fields] or [1])
        length = rng.choice([2**31 - 1, 2**32 + 5, 2**62])
        return kind, data + _varint(number << 3 | 2) + _varint(length) + b"abc"
    if kind == "splice" and data:
        at = rng.randrange(len(data))
        return kind, data[:at] + rng.randbytes(rng.randint(1, 16)) + data[at:]
    return "as_is", data


def grpc_outcome(
    call: Callable[[], bytes], response_type: type[Message], error_fields: tuple[str, ...]
) -> tuple[str, str]:
    """(outcome, detail) of one gRPC call made by ``call`` (raw bytes in and out)."""
    try:
        raw = call()
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return HANG, "no answer within the deadline"
        if code in _CLEAR_CODES and details.strip():
            return CLEAR, f"{code.name}: {details[:120]}"
        return UNCLEAR, f"{code.name if code else None}: {details[:200]}"
    try:
        response = response_type.FromString(raw)
    except DecodeError as e:
        return UNCLEAR, f"an undecodable response: {e}"
    for name in error_fields:
        if name in response.DESCRIPTOR.fields_by_name and response.HasField(name):
            message = getattr(response, name).message
            return (CLEAR, message[:120]) if message.strip() else (UNCLEAR, f"empty {name}")
    return ACCEPTED, ""


# ---------------------------------------------------------------------------- JSON lines
def random_json_value(rng: random.Random, depth: int = 0) -> Any:
    """A JSON-shaped value, sometimes of the wrong type for any field."""
    pick = rng.randrange(9 if depth < 2 else 6)
    if pick == 0:
        return rng.choice(_INTS)
    if pick == 1:
        return rng.choice(_FLOATS)
    if pick == 2:
        return rng.choice(_STRINGS)
    if pick == 3:
        return rng.random() < 0.5
    if pick == 4:
        return None
    if pick == 5:
        return rng.randint(-3, 64)
    if pick == 6:
        return [random_json_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {str(rng.randint(-2, 3)): random_json_value(rng, depth + 1) for _ in range(2)}


def _value_for(rng: random.Random, key: str) -> Any:
    """A wrong value for field ``key``."""
    if "nbytes" in key:  # never a size between small and absurd: see _SIZES
        return rng.choice(_SIZES)
    if _is_wait(key) and rng.random() < 0.5:
        return rng.choice(_WAITS)
    return random_json_value(rng)


def mutate_doc(rng: random.Random, doc: dict[str, Any]) -> tuple[str, bytes]:
    """(what was done, the line) of a mutation of a JSON request ``doc``."""
    kind = rng.choice(
        [
            "as_is",
            "wrong_value",
            "drop_field",
            "repeat_key",
            "unknown_field",
            "unknown_op",
            "bit_flips",
            "truncate",
            "deep_nesting",
            "not_an_object",
            "random_bytes",
        ]
    )
    doc = dict(doc)
    keys = [k for k in doc if k != "op"]
    if kind == "wrong_value" and keys:
        key = rng.choice(keys)
        doc[key] = _value_for(rng, key)
    elif kind == "drop_field" and keys:
        del doc[rng.choice(keys)]
    elif kind == "repeat_key" and keys:
        key = rng.choice(keys)
        extra = json.dumps(_value_for(rng, key))
        line = json.dumps(doc)[:-1] + f", {json.dumps(key)}: {extra}}}"
        return kind, line.encode() + b"\n"
    elif kind == "unknown_field":
        doc["surprise"] = random_json_value(rng)
    elif kind == "unknown_op":
        doc["op"] = rng.choice(["", "nope", 7, None, "LIST"])
    elif kind == "bit_flips":
        raw = bytearray(json.dumps(doc).encode())
        for _ in range(rng.randint(1, 6)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        return kind, bytes(raw).replace(b"\n", b" ") + b"\n"
    elif kind == "truncate":
        raw_line = json.dumps(doc).encode()
        return kind, raw_line[: rng.randrange(len(raw_line))] + b"\n"
    elif kind == "deep_nesting":
        depth = rng.choice([100, 5000, 100_000])
        return kind, (b'{"op": ' + b"[" * depth + b"]" * depth + b"}\n")
    elif kind == "not_an_object":
        return kind, json.dumps(random_json_value(rng)).encode() + b"\n"
    elif kind == "random_bytes":
        return kind, rng.randbytes(rng.randint(1, 200)).replace(b"\n", b"") + b"\n"
    return kind, json.dumps(doc, allow_nan=True).encode() + b"\n"


def line_outcome(reply: bytes | None, closed: bool) -> tuple[str, str]:
    """(outcome, detail) of a socket server's answer to one line: ``reply`` (None: no line
    within the deadline), ``closed`` when the server closed the connection without one."""
    if reply is None:
        return (CLEAR, "closed the connection") if closed else (HANG, "no answer")
    try:
        doc = json.loads(reply)
    except ValueError:
        return UNCLEAR, f"an unparsable reply: {reply[:80]!r}"
    if not isinstance(doc, dict) or not isinstance(doc.get("ok"), bool):
        return UNCLEAR, f"a reply without ok: {reply[:80]!r}"
    if doc["ok"]:
        return ACCEPTED, ""
    error = doc.get("error")
    if isinstance(error, str) and error.strip():
        return CLEAR, error[:120]
    return UNCLEAR, f"a refusal without an error: {reply[:80]!r}"


def read_line(sock: socket.socket, deadline_s: float) -> tuple[bytes | None, bool]:
    """(the first line the server sent or None, whether it closed the connection)."""
    sock.settimeout(deadline_s)
    got = b""
    try:
        while b"\n" not in got:
            chunk = sock.recv(65536)
            if not chunk:
                return (got or None), True
            got += chunk
    except TimeoutError:
        return None, False
    except OSError:
        return None, True  # reset by the server: it closed the connection
    return got.split(b"\n", 1)[0], False
