"""Master RPCs derived from one typed interface: codecs, client methods and the error convention.

An interface (`MasterApi`, `ShardingTransport`, `StreamTransport`) is a Protocol whose every
public method is one RPC of the proto's `Master` service: ``register_node`` is ``RegisterNode``
unless `rpc` names another. The request message's fields are the method's parameters by name
(a dataclass parameter without a field of its name spreads its fields into the request); the
result is the response's one value field, or the whole response when it has several. `Rpc`
builds both conversions from the signature and the proto's descriptors with the reflective
`Mapper`; the client's methods (`derive_client`) and the master's handlers
(`dlrover.master.server`) are made from it, so a new RPC is the proto, the interface and the
implementation.

One error convention: a call the master refuses answers with status OK and the response's
``refused`` field (a `MasterError`: the client raises `MasterRequestError` or
`UnknownNodeError`), or, for a sharding call, its ``error`` field (a `ShardingError` of the
same class). A non-OK status means the call never reached the API: no master, a wrong token,
an unknown method.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import operator
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from google.protobuf.message import Message

from dlrover.api.errors import MasterRequestError, UnknownNodeError
from dlrover.api.mapper import Descriptor, FieldDescriptor, Mapper, assign, message_class
from dlrover.proto import master_pb2 as pb
from dlrover.sharding import errors as sharding_errors

F = TypeVar("F", bound=Callable[..., Any])

SERVICE = pb.DESCRIPTOR.services_by_name["Master"]
"""The proto's one service: every RPC an interface method names is one of its methods."""

REFUSED = "refused"
"""The field of every response that carries the master's refusal (a MasterError)."""

SHARDING_ERROR = "error"
"""The field of a sharding response that carries the sharding subsystem's refusal."""

INVERT = operator.not_
"""A field converter for a boolean the proto states the other way round (with / without)."""

# Every class of dlrover.sharding.errors has its kind (tests/sharding/test_sharding_wire.py).
SHARDING_KINDS: dict[type[sharding_errors.ShardingError], int] = {
    sharding_errors.ShardingError: pb.ShardingError.SHARDING_ERROR,
    sharding_errors.InvalidSpecError: pb.ShardingError.INVALID_SPEC,
    sharding_errors.UnknownDatasetError: pb.ShardingError.UNKNOWN_DATASET,
    sharding_errors.DatasetConflictError: pb.ShardingError.DATASET_CONFLICT,
    sharding_errors.ShardRetriesExhaustedError: pb.ShardingError.SHARD_RETRIES_EXHAUSTED,
    sharding_errors.InvalidPositionError: pb.ShardingError.INVALID_POSITION,
    sharding_errors.ShardingTimeoutError: pb.ShardingError.SHARDING_TIMEOUT,
    sharding_errors.StreamSourceError: pb.ShardingError.STREAM_SOURCE,
}
_SHARDING_CLASSES = {kind: cls for cls, kind in SHARDING_KINDS.items()}


def sharding_error_to_proto(error: sharding_errors.ShardingError) -> pb.ShardingError:
    """The kind of the nearest class with one (a subclass travels as its base)."""
    kind = next(SHARDING_KINDS[cls] for cls in type(error).__mro__ if cls in SHARDING_KINDS)
    return pb.ShardingError(kind=kind, message=str(error))  # type: ignore[arg-type]


def sharding_error_from_proto(message: pb.ShardingError) -> sharding_errors.ShardingError:
    """The error to raise; a kind this side does not know becomes the base ShardingError."""
    return _SHARDING_CLASSES.get(message.kind, sharding_errors.ShardingError)(message.message)


def refusal_from_proto(message: pb.MasterError) -> MasterRequestError:
    """The error a client raises for the master's refusal."""
    if message.kind == pb.MasterError.UNKNOWN_NODE:
        return UnknownNodeError(message.message)
    return MasterRequestError(message.message)


def raise_refused(response: Message) -> None:
    """Raise the master's refusal a response carries (its ``refused`` field), if any."""
    if REFUSED in response.DESCRIPTOR.fields_by_name and response.HasField(REFUSED):
        raise refusal_from_proto(getattr(response, REFUSED))


def raise_sharding_error(response: Message) -> None:
    """Raise the sharding refusal a sharding response carries (its ``error`` field), if any."""
    error = response.DESCRIPTOR.fields_by_name.get(SHARDING_ERROR)
    is_sharding = error is not None and error.message_type is pb.ShardingError.DESCRIPTOR
    if is_sharding and response.HasField(SHARDING_ERROR):
        raise sharding_error_from_proto(getattr(response, SHARDING_ERROR))


class Run(str, enum.Enum):
    """How the master runs an RPC's implementation."""

    INLINE = "inline"
    """On its event loop: a quick call."""
    POOL = "pool"
    """On its thread pool: the call blocks a thread (a wait, a broker asked)."""
    POOL_IF_WAITING = "pool_if_waiting"
    """On the thread pool when its ``wait_s`` > 0, else inline."""
    POLL = "poll"
    """A long poll held on the loop: the implementation's method named by `RpcOptions.poll`
    returns a LongPoll (dlrover.master.local_api), held up to ``wait_s``."""


@dataclasses.dataclass(frozen=True)
class RpcOptions:
    """What an interface method says about its RPC beyond its signature."""

    name: str = ""
    """The proto RPC; "" is the method's name in CamelCase."""
    run: Run = Run.INLINE
    poll: str = ""
    """For Run.POLL: the implementation's method that takes the other arguments and returns
    the LongPoll."""
    max_wait_s: float | None = None
    """The master holds ``wait_s`` at most this long (the client asks again)."""
    fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """Request fields this method sets: two methods may share one RPC, told apart by these."""
    fields: Mapping[str, tuple[str, Callable[[Any], Any]]] = dataclasses.field(default_factory=dict)
    """A parameter carried by a field of another name, converted both ways by the function."""


def rpc(
    name: str = "",
    *,
    run: Run = Run.INLINE,
    poll: str = "",
    max_wait_s: float | None = None,
    fixed: Mapping[str, Any] | None = None,
    fields: Mapping[str, tuple[str, Callable[[Any], Any]]] | None = None,
) -> Callable[[F], F]:
    """Say more about an interface method's RPC (see RpcOptions); a method without it is an
    RPC all the same."""
    if run is Run.POLL and not poll:
        raise ValueError("a long poll names the implementation's method that returns it")
    options = RpcOptions(name, run, poll, max_wait_s, dict(fixed or {}), dict(fields or {}))

    def mark(method: F) -> F:
        method.__rpc__ = options  # type: ignore[attr-defined]
        return method

    return mark


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _value_fields(descriptor: Descriptor) -> list[FieldDescriptor]:
    """A response's fields that carry the answer (not a refusal)."""
    return [
        f
        for f in descriptor.fields
        if f.name != REFUSED
        and not (f.name == SHARDING_ERROR and f.message_type is pb.ShardingError.DESCRIPTOR)
    ]


class Rpc:
    """One interface method as one RPC: its options and the four conversions of its messages."""

    def __init__(self, interface: type, method: str, mapper: Mapper) -> None:
        function = getattr(interface, method)
        self.interface = interface
        self.method = method
        self.doc = function.__doc__ or ""
        self.options: RpcOptions = getattr(function, "__rpc__", RpcOptions())
        self.name = self.options.name or _camel(method)
        service_method = SERVICE.methods_by_name.get(self.name)
        if service_method is None:
            raise TypeError(f"{interface.__name__}.{method}: the proto has no rpc {self.name}")
        self.request_type = message_class(service_method.input_type)
        self.response_type = message_class(service_method.output_type)
        self.signature = inspect.signature(function)
        hints = typing.get_type_hints(function)
        self._mapper = mapper
        self._params = [p for p in self.signature.parameters if p != "self"]
        self._request_plan = [self._param_plan(p, hints[p]) for p in self._params]
        self._result_hint = hints.get("return")
        self._build_result()

    # --- request ------------------------------------------------------------------------------
    def _param_plan(self, param: str, hint: Any) -> tuple[str, str, Any, Any, Any]:
        """(param, field or "" to spread a dataclass, to-field, from-field, hint)."""
        descriptor = self.request_type.DESCRIPTOR
        field_name, convert = self.options.fields.get(param, (param, None))
        field = descriptor.fields_by_name.get(field_name)
        if field is None:
            if not dataclasses.is_dataclass(hint):
                raise TypeError(f"{self.name}: the request has no field {field_name!r}")
            return (param, "", self._mapper.encoder(hint, descriptor), None, hint)
        encode = self._mapper.field_encoder(hint, field)
        decode = self._mapper.field_decoder(hint, field)
        if convert is not None:
            encode = _then(convert, encode)
            decode = _then(decode, convert)
        return (param, field_name, encode, decode, hint)

    def encode_request(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Message:
        """The request message of a call ``method(*args, **kwargs)``."""
        bound = self.signature.bind(None, *args, **kwargs)
        bound.apply_defaults()
        request = self.request_type()
        for param, field, encode, _, _ in self._request_plan:
            value = bound.arguments[param]
            if value is None:
                continue  # an unset field
            if not field:
                request.MergeFrom(encode(value))
            else:
                assign(request, field, encode(value))
        for field, value in self.options.fixed.items():
            setattr(request, field, value)
        return request

    def decode_request(self, request: Message) -> dict[str, Any]:
        """The arguments a request carries, by parameter name; raises ValueError for a request
        without a message field it needs or with a value this side does not know."""
        args: dict[str, Any] = {}
        for param, field, _, decode, hint in self._request_plan:
            if not field:
                args[param] = self._mapper.decoder(hint, request.DESCRIPTOR)(request)
                continue
            descriptor = request.DESCRIPTOR.fields_by_name[field]
            unset = (
                descriptor.has_presence
                and not descriptor.is_repeated
                and not request.HasField(field)
            )
            if unset and _optional(hint):
                args[param] = None
                continue
            if unset and descriptor.message_type is not None:
                raise ValueError(f"{type(request).__name__} has no {field!r}: it is required")
            args[param] = decode(getattr(request, field))
        return args

    def matches(self, request: Message) -> bool:
        """Whether ``request`` is for this method (of those sharing its RPC)."""
        return all(getattr(request, k) == v for k, v in self.options.fixed.items())

    # --- response -----------------------------------------------------------------------------
    def _build_result(self) -> None:
        descriptor = self.response_type.DESCRIPTOR
        hint = self._result_hint
        values = _value_fields(descriptor)
        self._result_field = ""
        if hint is None or hint is type(None):
            self._encode_result: Callable[[Any], Message] = lambda _: self.response_type()
            self._decode_result: Callable[[Message], Any] = lambda _: None
        elif len(values) == 1:
            field = values[0]
            self._result_field = field.name
            encode = self._mapper.field_encoder(hint, field)
            decode = self._mapper.field_decoder(hint, field)
            maybe = _optional(hint) and field.has_presence
            self._encode_result = lambda v: self.response_type(
                **({} if v is None else {field.name: encode(v)})
            )
            self._decode_result = lambda m: (
                None if maybe and not m.HasField(field.name) else decode(getattr(m, field.name))
            )
        else:  # the whole response is the answer (a dataclass, or a tuple of its fields)
            self._encode_result = self._mapper.encoder(hint, descriptor)
            self._decode_result = self._mapper.decoder(hint, descriptor)

    def encode_response(self, result: Any) -> Message:
        """The response message of an answer."""
        return self._encode_result(result)

    def decode_response(self, response: Message) -> Any:
        """The answer a response carries; raises what the master refused the call with."""
        raise_refused(response)
        raise_sharding_error(response)
        return self._decode_result(response)

    def refusal(self, error: Exception, refusal_kind: Callable[[Exception], int | None]) -> Any:
        """The response that carries ``error`` as a refusal, or None when it is none (a bug)."""
        fields = self.response_type.DESCRIPTOR.fields_by_name
        if isinstance(error, sharding_errors.ShardingError) and SHARDING_ERROR in fields:
            return self.response_type(**{SHARDING_ERROR: sharding_error_to_proto(error)})
        kind = refusal_kind(error)
        if kind is None:
            return None
        refused = pb.MasterError(kind=kind, message=str(error))  # type: ignore[arg-type]
        return self.response_type(**{REFUSED: refused})


def _optional(hint: Any) -> bool:
    return type(None) in typing.get_args(hint)


def _then(first: Callable[[Any], Any], second: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda value: second(first(value))


def interface_methods(interface: type) -> list[str]:
    """The RPC methods of an interface: its public methods, in the order they are written."""
    return [
        name
        for name, value in vars(interface).items()
        if callable(value) and not name.startswith("_")
    ]


def rpcs(*interfaces: type, mapper: Mapper) -> dict[str, Rpc]:
    """Every RPC of the interfaces, by method name."""
    return {m: Rpc(i, m, mapper) for i in interfaces for m in interface_methods(i)}


def derive_client(name: str, table: Mapping[str, Rpc]) -> type:
    """A class whose method of each RPC calls ``self.invoke(rpc, args, kwargs)``: the client
    side of the interface (over gRPC, or in process), with its signatures and documentation."""

    def method_for(call: Rpc) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return self.invoke(call, args, kwargs)

        method.__name__ = method.__qualname__ = call.method
        method.__doc__ = f"{call.doc.strip()}\n\n({call.name} RPC.)"
        method.__signature__ = call.signature  # type: ignore[attr-defined]
        return method

    return type(name, (), {m: method_for(call) for m, call in table.items()})
