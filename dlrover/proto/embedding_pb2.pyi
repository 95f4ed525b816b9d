from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NO_REPLICA: _ClassVar[ReplicaMode]
    ASYNC: _ClassVar[ReplicaMode]
    SYNC: _ClassVar[ReplicaMode]
NO_REPLICA: ReplicaMode
ASYNC: ReplicaMode
SYNC: ReplicaMode

class ClientSeq(_message.Message):
    __slots__ = ("client", "seq", "floor")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FLOOR_FIELD_NUMBER: _ClassVar[int]
    client: str
    seq: int
    floor: int
    def __init__(self, client: _Optional[str] = ..., seq: _Optional[int] = ..., floor: _Optional[int] = ...) -> None: ...

class AppliedPushesRequest(_message.Message):
    __slots__ = ("client", "table")
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    client: str
    table: str
    def __init__(self, client: _Optional[str] = ..., table: _Optional[str] = ...) -> None: ...

class AppliedPushesResponse(_message.Message):
    __slots__ = ("error", "seqs", "floor")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    FLOOR_FIELD_NUMBER: _ClassVar[int]
    error: EmbeddingError
    seqs: _containers.RepeatedScalarFieldContainer[int]
    floor: int
    def __init__(self, error: _Optional[_Union[EmbeddingError, _Mapping]] = ..., seqs: _Optional[_Iterable[int]] = ..., floor: _Optional[int] = ...) -> None: ...

class PlacementResponse(_message.Message):
    __slots__ = ("error", "map")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MAP_FIELD_NUMBER: _ClassVar[int]
    error: EmbeddingError
    map: BucketMapMessage
    def __init__(self, error: _Optional[_Union[EmbeddingError, _Mapping]] = ..., map: _Optional[_Union[BucketMapMessage, _Mapping]] = ...) -> None: ...

class BucketMapMessage(_message.Message):
    __slots__ = ("version", "owners", "addresses")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OWNERS_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    version: int
    owners: bytes
    addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., owners: _Optional[bytes] = ..., addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class EmbeddingError(_message.Message):
    __slots__ = ("message", "kind", "map")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        INVALID: _ClassVar[EmbeddingError.Kind]
        NOT_OWNER: _ClassVar[EmbeddingError.Kind]
        MOVING: _ClassVar[EmbeddingError.Kind]
    INVALID: EmbeddingError.Kind
    NOT_OWNER: EmbeddingError.Kind
    MOVING: EmbeddingError.Kind
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MAP_FIELD_NUMBER: _ClassVar[int]
    message: str
    kind: EmbeddingError.Kind
    map: BucketMapMessage
    def __init__(self, message: _Optional[str] = ..., kind: _Optional[_Union[EmbeddingError.Kind, str]] = ..., map: _Optional[_Union[BucketMapMessage, _Mapping]] = ...) -> None: ...

class TableSpec(_message.Message):
    __slots__ = ("name", "dim", "optimizer", "lr", "initial_accumulator", "seed", "init_scale")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    INITIAL_ACCUMULATOR_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    INIT_SCALE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dim: int
    optimizer: str
    lr: float
    initial_accumulator: float
    seed: int
    init_scale: float
    def __init__(self, name: _Optional[str] = ..., dim: _Optional[int] = ..., optimizer: _Optional[str] = ..., lr: _Optional[float] = ..., initial_accumulator: _Optional[float] = ..., seed: _Optional[int] = ..., init_scale: _Optional[float] = ...) -> None: ...

class CreateTableRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ...) -> None: ...

class CreateTableResponse(_message.Message):
    __slots__ = ("error", "created")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    error: EmbeddingError
    created: bool
    def __init__(self, error: _Optional[_Union[EmbeddingError, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("table", "ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ...) -> None: ...

class SetMapRequest(_message.Message):
    __slots__ = ("map", "index", "frozen", "replica")
    MAP_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FROZEN_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    map: BucketMapMessage
    index: int
    frozen: bytes
    replica: ReplicaMode
    def __init__(self, map: _Optional[_Union[BucketMapMessage, _Mapping]] = ..., index: _Optional[int] = ..., frozen: _Optional[bytes] = ..., replica: _Optional[_Union[ReplicaMode, str]] = ...) -> None: ...

class SetMapResponse(_message.Message):
    __slots__ = ("error",)
    ERROR_FIELD_NUMBER: _ClassVar[int]
    error: EmbeddingError
    def __init__(self, error: _Optional[_Union[EmbeddingError, _Mapping]] = ...) -> None: ...

class BucketsRequest(_message.Message):
    __slots__ = ("table", "buckets", "num_buckets")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    NUM_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    table: str
    buckets: bytes
    num_buckets: int
    def __init__(self, table: _Optional[str] = ..., buckets: _Optional[bytes] = ..., num_buckets: _Optional[int] = ...) -> None: ...

class RowsMessage(_message.Message):
    __slots__ = ("error", "table", "ids", "rows", "accum", "dim", "seqs", "spec", "reset", "age_s")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ACCUM_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    error: EmbeddingError
    table: str
    ids: bytes
    rows: bytes
    accum: bytes
    dim: int
    seqs: _containers.RepeatedCompositeFieldContainer[ClientSeq]
    spec: TableSpec
    reset: bool
    age_s: float
    def __init__(self, error: _Optional[_Union[EmbeddingError, _Mapping]] = ..., table: _Optional[str] = ..., ids: _Optional[bytes] = ..., rows: _Optional[bytes] = ..., accum: _Optional[bytes] = ..., dim: _Optional[int] = ..., seqs: _Optional[_Iterable[_Union[ClientSeq, _Mapping]]] = ..., spec: _Optional[_Union[TableSpec, _Mapping]] = ..., reset: _Optional[bool] = ..., age_s: _Optional[float] = ...) -> None: ...

class ImportResponse(_message.Message):
    __slots__ = ("error", "rows")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    error: EmbeddingError
    rows: int
    def __init__(self, error: _Optional[_Union[EmbeddingError, _Mapping]] = ..., rows: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("error", "rows", "dim")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    error: EmbeddingError
    rows: bytes
    dim: int
    def __init__(self, error: _Optional[_Union[EmbeddingError, _Mapping]] = ..., rows: _Optional[bytes] = ..., dim: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("table", "ids", "grads", "client", "seq")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    grads: bytes
    client: str
    seq: int
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., grads: _Optional[bytes] = ..., client: _Optional[str] = ..., seq: _Optional[int] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("error", "applied", "duplicate")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    error: EmbeddingError
    applied: int
    duplicate: bool
    def __init__(self, error: _Optional[_Union[EmbeddingError, _Mapping]] = ..., applied: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataPortResponse(_message.Message):
    __slots__ = ("port",)
    PORT_FIELD_NUMBER: _ClassVar[int]
    port: int
    def __init__(self, port: _Optional[int] = ...) -> None: ...

class TableStats(_message.Message):
    __slots__ = ("name", "rows", "bytes", "lookups", "pushes", "spec")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    name: str
    rows: int
    bytes: int
    lookups: int
    pushes: int
    spec: TableSpec
    def __init__(self, name: _Optional[str] = ..., rows: _Optional[int] = ..., bytes: _Optional[int] = ..., lookups: _Optional[int] = ..., pushes: _Optional[int] = ..., spec: _Optional[_Union[TableSpec, _Mapping]] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tables", "map_version", "rows_moved_in", "rows_moved_out", "cpu_percent", "memory_bytes", "pid")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROWS_MOVED_IN_FIELD_NUMBER: _ClassVar[int]
    ROWS_MOVED_OUT_FIELD_NUMBER: _ClassVar[int]
    CPU_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableStats]
    map_version: int
    rows_moved_in: int
    rows_moved_out: int
    cpu_percent: float
    memory_bytes: int
    pid: int
    def __init__(self, tables: _Optional[_Iterable[_Union[TableStats, _Mapping]]] = ..., map_version: _Optional[int] = ..., rows_moved_in: _Optional[int] = ..., rows_moved_out: _Optional[int] = ..., cpu_percent: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., pid: _Optional[int] = ...) -> None: ...
