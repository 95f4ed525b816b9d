"""The wire's one reflective mapper: frozen dataclasses to protobuf messages and back, by name."""

from __future__ import annotations

import dataclasses
import enum
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from google.protobuf import message_factory
from google.protobuf.message import Message

T = TypeVar("T")

Encode = Callable[[Any], Any]
Decode = Callable[[Any], Any]
Descriptor = Any
"""A message's descriptor (protobuf's own class or its upb twin: both read alike)."""
FieldDescriptor = Any
"""A field's descriptor (likewise)."""


def message_class(descriptor: Descriptor) -> type[Message]:
    """The generated class of a message descriptor."""
    return message_factory.GetMessageClass(descriptor)


def _words(name: str) -> str:
    """ "DeliveryMode" -> "delivery mode", for error messages."""
    return re.sub(r"(?<!^)(?=[A-Z])", " ", name).lower()


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    """(T, True) for ``T | None``, (hint, False) otherwise."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0], True
    return hint, False


def _is_repeated(field: FieldDescriptor) -> bool:
    return bool(field.is_repeated)


def _is_message(field: FieldDescriptor) -> bool:
    return field.message_type is not None


@dataclasses.dataclass(frozen=True)
class Custom:
    """A hand-written conversion for a type the field-by-name rule does not fit; either side may
    be None (the reflective rule does that side)."""

    to_message: Callable[[Any], Message] | None = None
    from_message: Callable[[Any], Any] | None = None


class Mapper:
    """Converts a frozen dataclass to the protobuf message with fields of the same names and
    back, recursing into nested dataclasses, tuples (repeated fields, or a message's fields in
    order for a fixed-length tuple such as ``(epoch, index, offset)``), dicts (map fields) and
    enums (their value in a string field, their name in a proto enum); a hint that is the
    message's own generated class is that message, untouched.

    ``X | None`` is an unset field (a message or a proto3 ``optional`` scalar); an unset optional
    scalar whose dataclass field is not ``| None`` takes the dataclass default. ``paths`` renames
    dataclass fields to dotted message paths (``{HeartbeatReport: {"cpu_percent":
    "usage.cpu_percent"}}``); ``custom`` holds the few conversions written by hand. Decoding a
    dataclass runs its ``__post_init__``, so validation runs on the receiving side too; an
    unknown enum value raises ValueError. Plans are built once per (type, message) pair.
    """

    def __init__(
        self,
        paths: Mapping[type, Mapping[str, str]] | None = None,
        custom: Mapping[type, Custom] | None = None,
    ) -> None:
        self._paths = dict(paths or {})
        self._custom = dict(custom or {})
        # Filled as plans are first needed, from any thread: two threads may build the same
        # plan, and either result serves (a dict assignment is atomic).
        self._encoders: dict[tuple[Any, str], Encode] = {}
        self._decoders: dict[tuple[Any, str], Decode] = {}

    # --- public --------------------------------------------------------------------------------
    def to_message(self, value: Any, message: type[Message]) -> Message:
        """``value`` (a dataclass, or a tuple of a message's fields) as a ``message``."""
        return self.encoder(type(value), message.DESCRIPTOR)(value)  # type: ignore[no-any-return]

    def from_message(self, message: Message, cls: type[T]) -> T:
        """``message`` as a ``cls``."""
        return self.decoder(cls, message.DESCRIPTOR)(message)  # type: ignore[no-any-return]

    def pair(
        self, cls: type[T], message: type[Message]
    ) -> tuple[Callable[[T], Any], Callable[[Any], T]]:
        """The two conversions between ``cls`` and ``message``, as functions."""
        return (lambda v: self.to_message(v, message)), (lambda m: self.from_message(m, cls))

    def encoder(self, hint: Any, descriptor: Descriptor) -> Encode:
        """A function from a ``hint`` value to a ``descriptor`` message (built once)."""
        key = (hint, descriptor.full_name)
        if key not in self._encoders:
            self._encoders[key] = self._build_encoder(hint, descriptor)
        return self._encoders[key]

    def decoder(self, hint: Any, descriptor: Descriptor) -> Decode:
        """A function from a ``descriptor`` message to a ``hint`` value (built once)."""
        key = (hint, descriptor.full_name)
        if key not in self._decoders:
            self._decoders[key] = self._build_decoder(hint, descriptor)
        return self._decoders[key]

    def field_encoder(self, hint: Any, field: FieldDescriptor) -> Encode:
        """A function from a ``hint`` value to what the constructor of ``field``'s message takes
        for that field."""
        hint, _ = _unwrap_optional(hint)
        if _is_repeated(field) and field.message_type is not None and _is_map(field):
            return dict
        if _is_repeated(field):
            (item,) = typing.get_args(hint)[:1] or (Any,)
            one = self._value_encoder(item, field)
            return lambda values: [one(v) for v in values]
        return self._value_encoder(hint, field)

    def field_decoder(self, hint: Any, field: FieldDescriptor) -> Decode:
        """A function from ``field``'s value in a message to a ``hint`` value."""
        hint, _ = _unwrap_optional(hint)
        if _is_repeated(field) and field.message_type is not None and _is_map(field):
            return dict
        if _is_repeated(field):
            (item,) = typing.get_args(hint)[:1] or (Any,)
            one = self._value_decoder(item, field)
            return lambda values: tuple(one(v) for v in values)
        return self._value_decoder(hint, field)

    # --- plans ---------------------------------------------------------------------------------
    def _build_encoder(self, hint: Any, descriptor: Descriptor) -> Encode:
        cls = message_class(descriptor)
        if _is_message_class(hint, descriptor):
            return _identity
        custom = self._custom.get(hint)
        if custom is not None and custom.to_message is not None:
            return custom.to_message
        if dataclasses.is_dataclass(hint):
            return self._dataclass_encoder(typing.cast(type, hint), descriptor, cls)
        if typing.get_origin(hint) is tuple:  # a fixed tuple: the message's fields in order
            fields = descriptor.fields
            parts = [
                self.field_encoder(h, f)
                for h, f in zip(typing.get_args(hint), fields, strict=False)
            ]
            names = [f.name for f in fields]
            return lambda value: cls(
                **{n: p(v) for n, p, v in zip(names, parts, value, strict=False) if v is not None}
            )
        raise TypeError(f"no rule maps {hint!r} to the message {descriptor.full_name}")

    def _dataclass_encoder(self, hint: type, descriptor: Descriptor, cls: type[Message]) -> Encode:
        hints = typing.get_type_hints(hint)
        paths = self._paths.get(hint, {})
        plan: list[tuple[str, list[str], Encode]] = []
        for f in dataclasses.fields(hint):
            path = paths.get(f.name, f.name).split(".")
            field = _field_at(descriptor, path, hint)
            inner, _ = _unwrap_optional(hints[f.name])
            plan.append((f.name, path, self.field_encoder(inner, field)))

        def encode(value: Any) -> Message:
            kwargs: dict[str, Any] = {}
            nested: list[tuple[list[str], Any]] = []
            for name, path, convert in plan:
                item = getattr(value, name)
                if item is None:
                    continue
                if len(path) == 1:
                    kwargs[path[0]] = convert(item)
                else:
                    nested.append((path, convert(item)))
            message = cls(**kwargs)
            for path, item in nested:
                holder = message
                for part in path[:-1]:
                    holder = getattr(holder, part)
                assign(holder, path[-1], item)
            return message

        return encode

    def _build_decoder(self, hint: Any, descriptor: Descriptor) -> Decode:
        if _is_message_class(hint, descriptor):
            return _identity
        custom = self._custom.get(hint)
        if custom is not None and custom.from_message is not None:
            return custom.from_message
        if dataclasses.is_dataclass(hint):
            return self._dataclass_decoder(typing.cast(type, hint), descriptor)
        if typing.get_origin(hint) is tuple:
            args = typing.get_args(hint)
            fields = descriptor.fields[: len(args)]
            parts = [
                (f.name, f.has_presence and _unwrap_optional(h)[1], self.field_decoder(h, f))
                for h, f in zip(args, fields, strict=False)
            ]
            return lambda m: tuple(
                None if maybe and not m.HasField(n) else p(getattr(m, n)) for n, maybe, p in parts
            )
        raise TypeError(f"no rule maps the message {descriptor.full_name} to {hint!r}")

    def _dataclass_decoder(self, hint: type, descriptor: Descriptor) -> Decode:
        hints = typing.get_type_hints(hint)
        paths = self._paths.get(hint, {})
        plan: list[tuple[str, list[str], bool, bool, Decode]] = []
        for f in dataclasses.fields(hint):
            path = paths.get(f.name, f.name).split(".")
            field = _field_at(descriptor, path, hint)
            inner, optional = _unwrap_optional(hints[f.name])
            has_default = (
                f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            )
            present = field.has_presence and not _is_repeated(field)
            # Only an unset field that means None, or a default, is read as absent; an unset
            # message that a dataclass needs is read as the empty message, as before.
            absent_means = present and (optional or (has_default and not _is_message(field)))
            plan.append((f.name, path, absent_means, optional, self.field_decoder(inner, field)))

        def decode(message: Any) -> Any:
            kwargs: dict[str, Any] = {}
            for name, path, absent_means, optional, convert in plan:
                holder = message
                for part in path[:-1]:
                    holder = getattr(holder, part)
                if absent_means and not holder.HasField(path[-1]):
                    if optional:
                        kwargs[name] = None
                    continue
                kwargs[name] = convert(getattr(holder, path[-1]))
            return hint(**kwargs)

        return decode

    def _value_encoder(self, hint: Any, field: FieldDescriptor) -> Encode:
        hint, _ = _unwrap_optional(hint)
        if field.message_type is not None:
            return self.encoder(hint, field.message_type)
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return _enum_encoder(hint, field)
        return _identity

    def _value_decoder(self, hint: Any, field: FieldDescriptor) -> Decode:
        hint, _ = _unwrap_optional(hint)
        if field.message_type is not None:
            return self.decoder(hint, field.message_type)
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            return _enum_decoder(hint, field)
        if hint is bytes:
            return bytes
        return _identity


def _is_message_class(hint: Any, descriptor: Descriptor) -> bool:
    """Whether ``hint`` is the generated class of ``descriptor``'s message: taken as it is."""
    return (
        isinstance(hint, type)
        and issubclass(hint, Message)
        and hint.DESCRIPTOR.full_name == descriptor.full_name
    )


def _identity(value: Any) -> Any:
    return value


def _is_map(field: FieldDescriptor) -> bool:
    return bool(field.message_type.GetOptions().map_entry)


def _field_at(descriptor: Descriptor, path: Sequence[str], owner: type) -> FieldDescriptor:
    """The field a (dotted) path names; a dataclass field the message lacks is a bug."""
    field = None
    for part in path:
        field = descriptor.fields_by_name.get(part) if descriptor is not None else None
        if field is None:
            raise TypeError(
                f"{owner.__name__}: the message has no field {'.'.join(path)!r}; name the field "
                "alike on both sides, or map it in the Mapper's paths"
            )
        descriptor = field.message_type
    assert field is not None
    return field


def assign(message: Any, name: str, value: Any) -> None:
    """Set one field of an existing message, whatever its kind."""
    if isinstance(value, Message):
        getattr(message, name).CopyFrom(value)
    elif isinstance(value, list):
        getattr(message, name).extend(value)
    elif isinstance(value, dict):
        getattr(message, name).update(value)
    else:
        setattr(message, name, value)


def _enum_encoder(cls: type[enum.Enum], field: FieldDescriptor) -> Encode:
    if field.enum_type is None:  # a string field carries the value
        return lambda value: cls(value).value
    numbers = {member: field.enum_type.values_by_name[member.name].number for member in cls}
    return lambda value: numbers[cls(value)]


def _enum_decoder(cls: type[enum.Enum], field: FieldDescriptor) -> Decode:
    what = _words(cls.__name__)
    if field.enum_type is None:
        by_value = {member.value: member for member in cls}

        def from_value(value: Any) -> enum.Enum:
            if value not in by_value:
                known = ", ".join(repr(v) for v in by_value)
                raise ValueError(f"unknown {what} {value!r}: use one of {known}")
            return by_value[value]

        return from_value
    by_number = {field.enum_type.values_by_name[m.name].number: m for m in cls}

    def from_number(number: int) -> enum.Enum:
        if number not in by_number:
            raise ValueError(f"unknown {what} {number}")
        return by_number[number]

    return from_number
