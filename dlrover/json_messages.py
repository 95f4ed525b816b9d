"""Frozen dataclasses as JSON lines: the codec of the node-local channels (no pickle).

A message is a frozen dataclass whose fields are JSON-shaped: ``int``, ``float``, ``bool``,
``str``, ``Literal[...]``, ``X | None``, ``list[X]``, ``dict[str, X]``, ``dict[int, X]``
(the keys travel as strings) and nested message dataclasses. One message is one line: a JSON
object holding the channel's tag keys (``"op"``, ``"event"``, ...) and the message's fields.

`encode` checks the fields before sending and `from_fields` checks them on arrival, so a
malformed message fails with a `MessageError` naming the field at the end that made it, not
with a KeyError deep in a handler. Unknown fields are refused: both ends ship together.
The module imports only the standard library (the zygote imports it before anything else).
"""

from __future__ import annotations

import json
import types
import typing
from collections import Counter
from collections.abc import Mapping
from dataclasses import MISSING, fields, is_dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args, get_origin, get_type_hints

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    M = TypeVar("M", bound=DataclassInstance)

MAX_SHOWN_CHARS = 80


class MessageError(ValueError):
    """A line is not a valid message: not a JSON object, an unknown type or a bad field."""


def encode(message: DataclassInstance, **tags: str | bool) -> bytes:
    """One JSON line: the channel's ``tags`` and the fields of ``message`` (checked first)."""
    doc = to_fields(message)
    clash = sorted(set(tags) & set(doc))
    if clash:
        raise TypeError(f"{type(message).__name__} has fields named like tag keys: {clash}")
    from_fields(type(message), doc, f"cannot send {type(message).__name__}")  # must decode
    return json.dumps({**tags, **doc}).encode() + b"\n"


def parse(line: bytes | str, what: str) -> dict[str, object]:
    """The JSON object on ``line``; MessageError naming ``what`` if it is none."""
    try:
        doc = json.loads(line, object_pairs_hook=_unique_keys)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError and a repeated key
        raise MessageError(f"{what} is not JSON: {exc}: {_show(line)}") from None
    except RecursionError:  # nesting deeper than the parser's stack: no message nests so
        raise MessageError(f"{what} nests too deeply to be a message: {_show(line)}") from None
    if not isinstance(doc, dict):
        raise MessageError(f"{what} is not a JSON object: {_show(line)}")
    return doc


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """An object whose keys are all different: with a key twice, which one is meant is a guess
    two readers may make differently, so the message is refused."""
    doc = dict(pairs)
    if len(doc) != len(pairs):
        counts = Counter(key for key, _ in pairs)
        raise ValueError(
            f"keys given more than once: {sorted(k for k, n in counts.items() if n > 1)}"
        )
    return doc


def decode_tagged(
    doc: dict[str, object], tag_key: str, types_by_tag: Mapping[str, type[M]], what: str
) -> M:
    """The message that ``doc[tag_key]`` names in ``types_by_tag``, built from the other keys."""
    tag = doc.pop(tag_key, None)
    if not isinstance(tag, str) or tag not in types_by_tag:
        known = ", ".join(sorted(types_by_tag))
        raise MessageError(f"{what}: unknown {tag_key} {tag!r} (known: {known})")
    return from_fields(types_by_tag[tag], doc, f"{what} {tag!r}")


def to_fields(message: DataclassInstance) -> dict[str, object]:
    """The JSON object of ``message``'s fields (nested messages as objects, int keys as text)."""
    return {f.name: _dump(getattr(message, f.name)) for f in fields(message)}


def from_fields(cls: type[M], doc: Mapping[str, object], what: str) -> M:
    """Build ``cls`` from a JSON object, checking every field against its annotation."""
    try:
        return _build(cls, doc, "")
    except MessageError as exc:
        raise MessageError(f"{what}: {exc}") from None


def _dump(value: object) -> object:
    if is_dataclass(value) and not isinstance(value, type):
        return to_fields(value)
    if isinstance(value, Mapping):
        return {str(key): _dump(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_dump(item) for item in value]
    return value


@cache
def _field_types(cls: type) -> dict[str, tuple[Any, bool]]:
    """Field name -> (annotation, required) of a message dataclass."""
    hints = get_type_hints(cls)
    return {
        f.name: (hints[f.name], f.default is MISSING and f.default_factory is MISSING)
        for f in fields(cls)
        if f.init
    }


def _build(cls: type[M], doc: Mapping[str, object], path: str) -> M:
    field_types = _field_types(cls)
    unknown = sorted(set(doc) - set(field_types))
    if unknown:
        raise MessageError(f"unknown fields {unknown}" + (f" in field {path!r}" if path else ""))
    values: dict[str, object] = {}
    for name, (hint, required) in field_types.items():
        where = f"{path}.{name}" if path else name
        if name in doc:
            values[name] = _load(doc[name], hint, where)
        elif required:
            raise MessageError(f"field {where!r} is missing")
    return cls(**values)


def _load(value: object, hint: Any, where: str) -> object:
    """``value`` as the annotation ``hint`` wants it; MessageError if it does not fit."""
    origin, args = get_origin(hint), get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [arg for arg in args if arg is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"unsupported message field type {hint!r} at {where}")
        return _load(value, rest[0], where)
    if origin is Literal:
        if any(value == arg and type(value) is type(arg) for arg in args):
            return value
        raise _mismatch(where, " or ".join(repr(arg) for arg in args), value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _mismatch(where, "a bool", value)
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _mismatch(where, "an int", value)
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _mismatch(where, "a number", value)
    if hint is str:
        if isinstance(value, str):
            return value
        raise _mismatch(where, "a string", value)
    if origin is list:
        if not isinstance(value, list):
            raise _mismatch(where, "a list", value)
        return [_load(item, args[0], f"{where}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _mismatch(where, "an object", value)
        return {
            _load_key(key, args[0], where): _load(item, args[1], f"{where}[{key}]")
            for key, item in value.items()
        }
    if isinstance(hint, type) and is_dataclass(hint):
        if not isinstance(value, dict):
            raise _mismatch(where, "an object", value)
        return _build(hint, value, where)
    raise TypeError(f"unsupported message field type {hint!r} at {where}")


def _load_key(key: object, hint: Any, where: str) -> object:
    if hint is str and isinstance(key, str):
        return key
    if hint is int:
        if isinstance(key, int) and not isinstance(key, bool):
            return key
        if isinstance(key, str) and key.lstrip("-").isdigit():
            return int(key)
        raise MessageError(f"key {_show(key)} of field {where!r} must be an integer")
    if hint is not str:
        raise TypeError(f"unsupported message key type {hint!r} at {where}")
    raise MessageError(f"key {_show(key)} of field {where!r} must be a string")


def _mismatch(where: str, expected: str, value: object) -> MessageError:
    return MessageError(f"field {where!r} must be {expected}, got {_show(value)}")


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 3] + "..."
