"""RPCs derived from one typed interface: codecs, client methods and the error convention.

An interface (`MasterApi`, `ShardingTransport`, `StreamTransport`; the embedding server's
`EmbeddingServerApi`) is a Protocol whose every public method is one RPC of a proto service
(the `Master` service unless `rpcs` is given another): ``register_node`` is ``RegisterNode``
unless `rpc` names another. The request message's fields are the method's parameters by name
(a dataclass parameter without a field of its name spreads its fields into the request); the
result is the response's one value field, or the whole response when it has several; a parameter
or result typed as the request or response message itself is that message, untouched. `Rpc`
builds both conversions from the signature and the proto's descriptors with the reflective
`Mapper`; the client's methods (`derive_client`) and the master's handlers
(`dlrover.master.server`) are made from it, so a new RPC is the proto, the interface and the
implementation.

One error convention on every service: a refused call answers with status OK and the refusal
inside the response, as a kind and a message, in the field whose type is one of the service's
`Refusal`s: the master's ``refused`` (a `MasterError`: the client raises `MasterRequestError` or
`UnknownNodeError`), a sharding call's ``error`` (a `ShardingError`: the class of
dlrover.sharding.errors), an embedding server's ``error`` (an `EmbeddingError`). `Rpc.refusal`
and `Rpc.decode_response` are the one place that maps errors both ways, each by its service's
`Refusal`s. A non-OK status means the call never reached the API: no server, a wrong token, an
unknown method, a request that does not parse.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import operator
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from google.protobuf.message import Message

from dlrover.api.errors import MasterRequestError, UnknownNodeError
from dlrover.api.mapper import Descriptor, Mapper, assign, message_class
from dlrover.proto import master_pb2 as pb
from dlrover.sharding import errors as sharding_errors

F = TypeVar("F", bound=Callable[..., Any])

SERVICE = pb.DESCRIPTOR.services_by_name["Master"]
"""The master's service: every RPC a master interface method names is one of its methods."""

REFUSED = "refused"
"""The field of every response that carries the master's refusal (a MasterError)."""

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


def refusal_to_proto(error: MasterRequestError) -> pb.MasterError:
    """The master's refusal of a call that raised ``error``."""
    kind = (
        pb.MasterError.UNKNOWN_NODE
        if isinstance(error, UnknownNodeError)
        else pb.MasterError.REQUEST
    )
    return pb.MasterError(kind=kind, message=str(error))  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class Refusal:
    """How one family of errors travels as a refusal: the error message a response carries it
    in, the base class of the errors, and the conversions both ways."""

    message: type[Message]
    error: type[Exception]
    to_message: Callable[[Any], Message]
    from_message: Callable[[Any], Exception]


MASTER_REFUSALS = (
    Refusal(
        pb.ShardingError,
        sharding_errors.ShardingError,
        sharding_error_to_proto,
        sharding_error_from_proto,
    ),
    Refusal(pb.MasterError, MasterRequestError, refusal_to_proto, refusal_from_proto),
)
"""The master's refusals: a sharding call's, then any call's."""


def raise_refused(response: Message) -> None:
    """Raise the master's refusal a response carries (its ``refused`` field), if any."""
    if REFUSED in response.DESCRIPTOR.fields_by_name and response.HasField(REFUSED):
        raise refusal_from_proto(getattr(response, REFUSED))


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
    framed: bool = False
    """A hot-path call: the server reads the request's bytes and writes the answer's in pieces
    without copying their arrays, by the implementation's ``<method>_frames(raw)``; the
    message form (this method) is the same bytes, for every other caller."""


def rpc(
    name: str = "",
    *,
    run: Run = Run.INLINE,
    poll: str = "",
    max_wait_s: float | None = None,
    fixed: Mapping[str, Any] | None = None,
    fields: Mapping[str, tuple[str, Callable[[Any], Any]]] | None = None,
    framed: bool = False,
) -> Callable[[F], F]:
    """Say more about an interface method's RPC (see RpcOptions); a method without it is an
    RPC all the same."""
    if run is Run.POLL and not poll:
        raise ValueError("a long poll names the implementation's method that returns it")
    options = RpcOptions(name, run, poll, max_wait_s, dict(fixed or {}), dict(fields or {}), framed)

    def mark(method: F) -> F:
        method.__rpc__ = options  # type: ignore[attr-defined]
        return method

    return mark


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


class Rpc:
    """One interface method as one RPC: its options and the four conversions of its messages."""

    def __init__(
        self,
        interface: type,
        method: str,
        mapper: Mapper,
        service: Descriptor = SERVICE,
        refusals: Sequence[Refusal] = MASTER_REFUSALS,
    ) -> None:
        function = getattr(interface, method)
        self.interface = interface
        self.method = method
        self.doc = function.__doc__ or ""
        self.options: RpcOptions = getattr(function, "__rpc__", RpcOptions())
        self.name = self.options.name or _camel(method)
        self.service = service
        service_method = service.methods_by_name.get(self.name)
        if service_method is None:
            raise TypeError(f"{interface.__name__}.{method}: the proto has no rpc {self.name}")
        self.request_type = message_class(service_method.input_type)
        self.response_type = message_class(service_method.output_type)
        self.signature = inspect.signature(function)
        hints = typing.get_type_hints(function)
        self._mapper = mapper
        by_type = {r.message.DESCRIPTOR.full_name: r for r in refusals}
        self._refusals = [
            (f.name, by_type[f.message_type.full_name])
            for f in self.response_type.DESCRIPTOR.fields
            if f.message_type is not None and f.message_type.full_name in by_type
        ]
        """The response's refusal fields and their Refusal, most specific error class first."""
        order = [r.message.DESCRIPTOR.full_name for r in refusals]
        self._refusals.sort(key=lambda item: order.index(item[1].message.DESCRIPTOR.full_name))
        self._params = [p for p in self.signature.parameters if p != "self"]
        self._whole_request = [hints[p] for p in self._params] == [self.request_type]
        """The one parameter is the request message itself."""
        self._request_plan = [self._param_plan(p, hints[p]) for p in self._params]
        self._result_hint = hints.get("return")
        self._build_result()

    # --- request ------------------------------------------------------------------------------
    def _param_plan(self, param: str, hint: Any) -> tuple[str, str, Any, Any, Any]:
        """(param, field or "" to spread a dataclass, to-field, from-field, hint)."""
        descriptor = self.request_type.DESCRIPTOR
        if self._whole_request:
            return (param, "", None, None, hint)
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
        if self._whole_request:
            return bound.arguments[self._params[0]]  # type: ignore[no-any-return]
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
        if self._whole_request:
            return {self._params[0]: request}
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
        refusals = {name for name, _ in self._refusals}
        values = [f for f in descriptor.fields if f.name not in refusals]
        self._result_field = ""
        self._encode_result: Callable[[Any], Message] = _identity
        self._decode_result: Callable[[Message], Any] = _identity
        if hint is self.response_type:  # the response itself
            pass
        elif hint is None or hint is type(None):
            self._encode_result = lambda _: self.response_type()
            self._decode_result = lambda _: None
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
        """The answer a response carries; raises what the server refused the call with."""
        self.raise_refusal(response)
        return self._decode_result(response)

    def raise_refusal(self, response: Message) -> None:
        """Raise the refusal ``response`` carries, if any, as its error class."""
        for name, refusal in self._refusals:
            if response.HasField(name):
                raise refusal.from_message(getattr(response, name))

    def refusal(self, error: Exception | None) -> Any:
        """The response that carries ``error`` as a refusal, or None when it is none of this
        RPC's refusals (a bug: the call fails with status UNKNOWN)."""
        for name, refusal in self._refusals:
            if isinstance(error, refusal.error):
                return self.response_type(**{name: refusal.to_message(error)})
        return None


def _identity(value: Any) -> Any:
    return value


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


def rpcs(
    *interfaces: type,
    mapper: Mapper,
    service: Descriptor = SERVICE,
    refusals: Sequence[Refusal] = MASTER_REFUSALS,
) -> dict[str, Rpc]:
    """Every RPC of the interfaces (methods of ``service``), by method name."""
    return {
        m: Rpc(i, m, mapper, service, refusals) for i in interfaces for m in interface_methods(i)
    }


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
