from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MasterError(_message.Message):
    __slots__ = ("kind", "message")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        REQUEST: _ClassVar[MasterError.Kind]
        UNKNOWN_NODE: _ClassVar[MasterError.Kind]
    REQUEST: MasterError.Kind
    UNKNOWN_NODE: MasterError.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    kind: MasterError.Kind
    message: str
    def __init__(self, kind: _Optional[_Union[MasterError.Kind, str]] = ..., message: _Optional[str] = ...) -> None: ...

class JobConfig(_message.Message):
    __slots__ = ("min_nodes", "max_nodes", "node_unit", "last_call_timeout_s", "job_name")
    MIN_NODES_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    NODE_UNIT_FIELD_NUMBER: _ClassVar[int]
    LAST_CALL_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    min_nodes: int
    max_nodes: int
    node_unit: int
    last_call_timeout_s: float
    job_name: str
    def __init__(self, min_nodes: _Optional[int] = ..., max_nodes: _Optional[int] = ..., node_unit: _Optional[int] = ..., last_call_timeout_s: _Optional[float] = ..., job_name: _Optional[str] = ...) -> None: ...

class RegisterNodeRequest(_message.Message):
    __slots__ = ("node_id", "host", "role", "local_world_size", "requested_rank", "config", "pid")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_RANK_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    host: str
    role: str
    local_world_size: int
    requested_rank: int
    config: JobConfig
    pid: int
    def __init__(self, node_id: _Optional[str] = ..., host: _Optional[str] = ..., role: _Optional[str] = ..., local_world_size: _Optional[int] = ..., requested_rank: _Optional[int] = ..., config: _Optional[_Union[JobConfig, _Mapping]] = ..., pid: _Optional[int] = ...) -> None: ...

class RegisterNodeResponse(_message.Message):
    __slots__ = ("node_id", "incarnation", "config", "heartbeat_interval_s", "refused")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    config: JobConfig
    heartbeat_interval_s: float
    refused: MasterError
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., config: _Optional[_Union[JobConfig, _Mapping]] = ..., heartbeat_interval_s: _Optional[float] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class ResourceUsage(_message.Message):
    __slots__ = ("cpu_percent", "memory_bytes")
    CPU_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    cpu_percent: float
    memory_bytes: int
    def __init__(self, cpu_percent: _Optional[float] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "incarnation", "usage", "step", "worker_state", "restart_count", "step_time_s", "attempt_step", "attempt_step_age_s", "attempt_first_step", "attempt_first_age_s", "step_wall_s", "step_data_s", "step_checkpoint_s", "checkpoint_persist_s", "worker_pids", "samples_per_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORKER_STATE_FIELD_NUMBER: _ClassVar[int]
    RESTART_COUNT_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_STEP_AGE_S_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIRST_STEP_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIRST_AGE_S_FIELD_NUMBER: _ClassVar[int]
    STEP_WALL_S_FIELD_NUMBER: _ClassVar[int]
    STEP_DATA_S_FIELD_NUMBER: _ClassVar[int]
    STEP_CHECKPOINT_S_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_PERSIST_S_FIELD_NUMBER: _ClassVar[int]
    WORKER_PIDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    usage: ResourceUsage
    step: int
    worker_state: str
    restart_count: int
    step_time_s: float
    attempt_step: int
    attempt_step_age_s: float
    attempt_first_step: int
    attempt_first_age_s: float
    step_wall_s: float
    step_data_s: float
    step_checkpoint_s: float
    checkpoint_persist_s: float
    worker_pids: _containers.RepeatedScalarFieldContainer[int]
    samples_per_s: float
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., usage: _Optional[_Union[ResourceUsage, _Mapping]] = ..., step: _Optional[int] = ..., worker_state: _Optional[str] = ..., restart_count: _Optional[int] = ..., step_time_s: _Optional[float] = ..., attempt_step: _Optional[int] = ..., attempt_step_age_s: _Optional[float] = ..., attempt_first_step: _Optional[int] = ..., attempt_first_age_s: _Optional[float] = ..., step_wall_s: _Optional[float] = ..., step_data_s: _Optional[float] = ..., step_checkpoint_s: _Optional[float] = ..., checkpoint_persist_s: _Optional[float] = ..., worker_pids: _Optional[_Iterable[int]] = ..., samples_per_s: _Optional[float] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("action", "job_state", "heartbeat_interval_s", "heartbeat_port", "refused")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    JOB_STATE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_PORT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    action: str
    job_state: str
    heartbeat_interval_s: float
    heartbeat_port: int
    refused: MasterError
    def __init__(self, action: _Optional[str] = ..., job_state: _Optional[str] = ..., heartbeat_interval_s: _Optional[float] = ..., heartbeat_port: _Optional[int] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class JoinRendezvousRequest(_message.Message):
    __slots__ = ("node_id", "incarnation", "local_world_size", "store_host", "store_port")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    local_world_size: int
    store_host: str
    store_port: int
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., local_world_size: _Optional[int] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ...) -> None: ...

class JoinRendezvousResponse(_message.Message):
    __slots__ = ("round", "refused")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    round: int
    refused: MasterError
    def __init__(self, round: _Optional[int] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class GetCommWorldRequest(_message.Message):
    __slots__ = ("node_id", "round", "wait_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    round: int
    wait_s: float
    def __init__(self, node_id: _Optional[str] = ..., round: _Optional[int] = ..., wait_s: _Optional[float] = ...) -> None: ...

class CommWorld(_message.Message):
    __slots__ = ("round", "complete", "node_rank", "world_size", "rank_offset", "store_host", "store_port", "excluded", "message", "rejoin", "num_nodes", "spare", "spread_s", "refused")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REJOIN_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    SPREAD_S_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    round: int
    complete: bool
    node_rank: int
    world_size: int
    rank_offset: int
    store_host: str
    store_port: int
    excluded: bool
    message: str
    rejoin: bool
    num_nodes: int
    spare: bool
    spread_s: float
    refused: MasterError
    def __init__(self, round: _Optional[int] = ..., complete: _Optional[bool] = ..., node_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., rank_offset: _Optional[int] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., excluded: _Optional[bool] = ..., message: _Optional[str] = ..., rejoin: _Optional[bool] = ..., num_nodes: _Optional[int] = ..., spare: _Optional[bool] = ..., spread_s: _Optional[float] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class NumNodesWaitingRequest(_message.Message):
    __slots__ = ("node_id", "round", "wait_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    round: int
    wait_s: float
    def __init__(self, node_id: _Optional[str] = ..., round: _Optional[int] = ..., wait_s: _Optional[float] = ...) -> None: ...

class NumNodesWaitingResponse(_message.Message):
    __slots__ = ("waiting", "latest_round", "job_ended", "spread_s", "refused")
    WAITING_FIELD_NUMBER: _ClassVar[int]
    LATEST_ROUND_FIELD_NUMBER: _ClassVar[int]
    JOB_ENDED_FIELD_NUMBER: _ClassVar[int]
    SPREAD_S_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    waiting: int
    latest_round: int
    job_ended: bool
    spread_s: float
    refused: MasterError
    def __init__(self, waiting: _Optional[int] = ..., latest_round: _Optional[int] = ..., job_ended: _Optional[bool] = ..., spread_s: _Optional[float] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class KvSetRequest(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class KvSetResponse(_message.Message):
    __slots__ = ("refused",)
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    refused: MasterError
    def __init__(self, refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class KvGetRequest(_message.Message):
    __slots__ = ("key", "wait_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    key: str
    wait_s: float
    def __init__(self, key: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class KvGetResponse(_message.Message):
    __slots__ = ("value", "refused")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    refused: MasterError
    def __init__(self, value: _Optional[bytes] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class ReportStepRequest(_message.Message):
    __slots__ = ("node_id", "rank", "step", "timestamp", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    rank: int
    step: int
    timestamp: float
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, node_id: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[int] = ..., timestamp: _Optional[float] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class ReportStepResponse(_message.Message):
    __slots__ = ("refused",)
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    refused: MasterError
    def __init__(self, refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class ReportNodeStatusRequest(_message.Message):
    __slots__ = ("node_id", "incarnation", "status", "exit_code", "reason", "wait_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    status: str
    exit_code: int
    reason: str
    wait_s: float
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., status: _Optional[str] = ..., exit_code: _Optional[int] = ..., reason: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class ReportNodeStatusResponse(_message.Message):
    __slots__ = ("job_done", "refused")
    JOB_DONE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    job_done: bool
    refused: MasterError
    def __init__(self, job_done: _Optional[bool] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class GetJobStatusRequest(_message.Message):
    __slots__ = ("without_nodes",)
    WITHOUT_NODES_FIELD_NUMBER: _ClassVar[int]
    without_nodes: bool
    def __init__(self, without_nodes: _Optional[bool] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("step_wall_s", "step_data_s", "step_checkpoint_s", "node_id", "state", "node_rank", "host", "step", "restart_count", "last_heartbeat_age_s", "role", "cpu_percent", "memory_bytes", "check", "score", "pid", "worker_pids", "memory_limit_bytes", "samples_per_s")
    STEP_WALL_S_FIELD_NUMBER: _ClassVar[int]
    STEP_DATA_S_FIELD_NUMBER: _ClassVar[int]
    STEP_CHECKPOINT_S_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RESTART_COUNT_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CPU_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECK_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    WORKER_PIDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    step_wall_s: float
    step_data_s: float
    step_checkpoint_s: float
    node_id: str
    state: str
    node_rank: int
    host: str
    step: int
    restart_count: int
    last_heartbeat_age_s: float
    role: str
    cpu_percent: float
    memory_bytes: int
    check: str
    score: float
    pid: int
    worker_pids: _containers.RepeatedScalarFieldContainer[int]
    memory_limit_bytes: int
    samples_per_s: float
    def __init__(self, step_wall_s: _Optional[float] = ..., step_data_s: _Optional[float] = ..., step_checkpoint_s: _Optional[float] = ..., node_id: _Optional[str] = ..., state: _Optional[str] = ..., node_rank: _Optional[int] = ..., host: _Optional[str] = ..., step: _Optional[int] = ..., restart_count: _Optional[int] = ..., last_heartbeat_age_s: _Optional[float] = ..., role: _Optional[str] = ..., cpu_percent: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., check: _Optional[str] = ..., score: _Optional[float] = ..., pid: _Optional[int] = ..., worker_pids: _Optional[_Iterable[int]] = ..., memory_limit_bytes: _Optional[int] = ..., samples_per_s: _Optional[float] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_name", "state", "round", "nodes", "reason", "exit_code", "node_check", "autoscale", "goodput", "metrics_port", "embedding_servers", "steps_per_s", "samples_per_s", "data_lost", "refused")
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    NODE_CHECK_FIELD_NUMBER: _ClassVar[int]
    AUTOSCALE_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_SERVERS_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    DATA_LOST_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    job_name: str
    state: str
    round: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    reason: str
    exit_code: int
    node_check: str
    autoscale: str
    goodput: float
    metrics_port: int
    embedding_servers: _containers.RepeatedCompositeFieldContainer[EmbeddingServerStatus]
    steps_per_s: float
    samples_per_s: float
    data_lost: str
    refused: MasterError
    def __init__(self, job_name: _Optional[str] = ..., state: _Optional[str] = ..., round: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., reason: _Optional[str] = ..., exit_code: _Optional[int] = ..., node_check: _Optional[str] = ..., autoscale: _Optional[str] = ..., goodput: _Optional[float] = ..., metrics_port: _Optional[int] = ..., embedding_servers: _Optional[_Iterable[_Union[EmbeddingServerStatus, _Mapping]]] = ..., steps_per_s: _Optional[float] = ..., samples_per_s: _Optional[float] = ..., data_lost: _Optional[str] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class EmbeddingServerStatus(_message.Message):
    __slots__ = ("index", "address", "rows", "bytes", "lookups_per_s")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    index: int
    address: str
    rows: int
    bytes: int
    lookups_per_s: float
    def __init__(self, index: _Optional[int] = ..., address: _Optional[str] = ..., rows: _Optional[int] = ..., bytes: _Optional[int] = ..., lookups_per_s: _Optional[float] = ...) -> None: ...

class JoinNodeCheckRequest(_message.Message):
    __slots__ = ("node_id", "incarnation", "rdzv_round", "check_round", "addr", "straggler_ratio", "exclude_stragglers", "wait_s")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RDZV_ROUND_FIELD_NUMBER: _ClassVar[int]
    CHECK_ROUND_FIELD_NUMBER: _ClassVar[int]
    ADDR_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_RATIO_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_STRAGGLERS_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    rdzv_round: int
    check_round: int
    addr: str
    straggler_ratio: float
    exclude_stragglers: bool
    wait_s: float
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., rdzv_round: _Optional[int] = ..., check_round: _Optional[int] = ..., addr: _Optional[str] = ..., straggler_ratio: _Optional[float] = ..., exclude_stragglers: _Optional[bool] = ..., wait_s: _Optional[float] = ...) -> None: ...

class NodeCheckTask(_message.Message):
    __slots__ = ("state", "check_round", "peers", "index", "excluded", "reason", "summary", "refused")
    STATE_FIELD_NUMBER: _ClassVar[int]
    CHECK_ROUND_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    state: str
    check_round: int
    peers: _containers.RepeatedScalarFieldContainer[str]
    index: int
    excluded: bool
    reason: str
    summary: str
    refused: MasterError
    def __init__(self, state: _Optional[str] = ..., check_round: _Optional[int] = ..., peers: _Optional[_Iterable[str]] = ..., index: _Optional[int] = ..., excluded: _Optional[bool] = ..., reason: _Optional[str] = ..., summary: _Optional[str] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class ReportNodeCheckRequest(_message.Message):
    __slots__ = ("node_id", "incarnation", "rdzv_round", "check_round", "ok", "compute_s", "comm_s", "error")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RDZV_ROUND_FIELD_NUMBER: _ClassVar[int]
    CHECK_ROUND_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    COMM_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    rdzv_round: int
    check_round: int
    ok: bool
    compute_s: float
    comm_s: float
    error: str
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., rdzv_round: _Optional[int] = ..., check_round: _Optional[int] = ..., ok: _Optional[bool] = ..., compute_s: _Optional[float] = ..., comm_s: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class ReportNodeCheckResponse(_message.Message):
    __slots__ = ("refused",)
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    refused: MasterError
    def __init__(self, refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class FailureRecord(_message.Message):
    __slots__ = ("at", "node_id", "failure_class", "action", "root_cause", "restart_count", "round", "cost_s", "signature", "collectives", "count", "first_at", "node_count")
    AT_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FAILURE_CLASS_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    ROOT_CAUSE_FIELD_NUMBER: _ClassVar[int]
    RESTART_COUNT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    COST_S_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVES_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    FIRST_AT_FIELD_NUMBER: _ClassVar[int]
    NODE_COUNT_FIELD_NUMBER: _ClassVar[int]
    at: float
    node_id: str
    failure_class: str
    action: str
    root_cause: str
    restart_count: int
    round: int
    cost_s: float
    signature: str
    collectives: str
    count: int
    first_at: float
    node_count: int
    def __init__(self, at: _Optional[float] = ..., node_id: _Optional[str] = ..., failure_class: _Optional[str] = ..., action: _Optional[str] = ..., root_cause: _Optional[str] = ..., restart_count: _Optional[int] = ..., round: _Optional[int] = ..., cost_s: _Optional[float] = ..., signature: _Optional[str] = ..., collectives: _Optional[str] = ..., count: _Optional[int] = ..., first_at: _Optional[float] = ..., node_count: _Optional[int] = ...) -> None: ...

class ReportFailureRequest(_message.Message):
    __slots__ = ("node_id", "incarnation", "record")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    record: FailureRecord
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., record: _Optional[_Union[FailureRecord, _Mapping]] = ...) -> None: ...

class ReportFailureResponse(_message.Message):
    __slots__ = ("refused",)
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    refused: MasterError
    def __init__(self, refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class GetFailuresRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetFailuresResponse(_message.Message):
    __slots__ = ("failures", "refused")
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    failures: _containers.RepeatedCompositeFieldContainer[FailureRecord]
    refused: MasterError
    def __init__(self, failures: _Optional[_Iterable[_Union[FailureRecord, _Mapping]]] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class StopJobRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class ScaleRoleRequest(_message.Message):
    __slots__ = ("role", "count")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    role: str
    count: int
    def __init__(self, role: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class ScaleRoleResponse(_message.Message):
    __slots__ = ("message", "request_id", "refused")
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    message: str
    request_id: int
    refused: MasterError
    def __init__(self, message: _Optional[str] = ..., request_id: _Optional[int] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class CheckpointPersistedRequest(_message.Message):
    __slots__ = ("step", "node_rank", "total_nodes")
    STEP_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NODES_FIELD_NUMBER: _ClassVar[int]
    step: int
    node_rank: int
    total_nodes: int
    def __init__(self, step: _Optional[int] = ..., node_rank: _Optional[int] = ..., total_nodes: _Optional[int] = ...) -> None: ...

class CheckpointPersistedResponse(_message.Message):
    __slots__ = ("committer", "refused")
    COMMITTER_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    committer: bool
    refused: MasterError
    def __init__(self, committer: _Optional[bool] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class CheckpointCommittedRequest(_message.Message):
    __slots__ = ("step", "mark", "wait_s")
    STEP_FIELD_NUMBER: _ClassVar[int]
    MARK_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    step: int
    mark: bool
    wait_s: float
    def __init__(self, step: _Optional[int] = ..., mark: _Optional[bool] = ..., wait_s: _Optional[float] = ...) -> None: ...

class CheckpointCommittedResponse(_message.Message):
    __slots__ = ("committed", "refused")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    committed: bool
    refused: MasterError
    def __init__(self, committed: _Optional[bool] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class AgreeLoadStepRequest(_message.Message):
    __slots__ = ("node_rank", "total_nodes", "local_step", "round_id", "wait_s")
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NODES_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEP_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    node_rank: int
    total_nodes: int
    local_step: int
    round_id: int
    wait_s: float
    def __init__(self, node_rank: _Optional[int] = ..., total_nodes: _Optional[int] = ..., local_step: _Optional[int] = ..., round_id: _Optional[int] = ..., wait_s: _Optional[float] = ...) -> None: ...

class AgreeLoadStepResponse(_message.Message):
    __slots__ = ("decided", "step", "refused")
    DECIDED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    decided: bool
    step: int
    refused: MasterError
    def __init__(self, decided: _Optional[bool] = ..., step: _Optional[int] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class ShardingError(_message.Message):
    __slots__ = ("kind", "message")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        SHARDING_ERROR: _ClassVar[ShardingError.Kind]
        INVALID_SPEC: _ClassVar[ShardingError.Kind]
        UNKNOWN_DATASET: _ClassVar[ShardingError.Kind]
        DATASET_CONFLICT: _ClassVar[ShardingError.Kind]
        SHARD_RETRIES_EXHAUSTED: _ClassVar[ShardingError.Kind]
        INVALID_POSITION: _ClassVar[ShardingError.Kind]
        SHARDING_TIMEOUT: _ClassVar[ShardingError.Kind]
        STREAM_SOURCE: _ClassVar[ShardingError.Kind]
    SHARDING_ERROR: ShardingError.Kind
    INVALID_SPEC: ShardingError.Kind
    UNKNOWN_DATASET: ShardingError.Kind
    DATASET_CONFLICT: ShardingError.Kind
    SHARD_RETRIES_EXHAUSTED: ShardingError.Kind
    INVALID_POSITION: ShardingError.Kind
    SHARDING_TIMEOUT: ShardingError.Kind
    STREAM_SOURCE: ShardingError.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    kind: ShardingError.Kind
    message: str
    def __init__(self, kind: _Optional[_Union[ShardingError.Kind, str]] = ..., message: _Optional[str] = ...) -> None: ...

class DatasetSpec(_message.Message):
    __slots__ = ("name", "size", "shard_size", "batch_size", "batches_per_shard", "epochs", "shuffle", "seed", "mode", "max_retries", "lease_s")
    class DeliveryMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        AT_LEAST_ONCE: _ClassVar[DatasetSpec.DeliveryMode]
        EXACTLY_ONCE: _ClassVar[DatasetSpec.DeliveryMode]
        AT_MOST_ONCE: _ClassVar[DatasetSpec.DeliveryMode]
    AT_LEAST_ONCE: DatasetSpec.DeliveryMode
    EXACTLY_ONCE: DatasetSpec.DeliveryMode
    AT_MOST_ONCE: DatasetSpec.DeliveryMode
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHARD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCHES_PER_SHARD_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_RETRIES_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    shard_size: int
    batch_size: int
    batches_per_shard: int
    epochs: int
    shuffle: bool
    seed: int
    mode: DatasetSpec.DeliveryMode
    max_retries: int
    lease_s: float
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., shard_size: _Optional[int] = ..., batch_size: _Optional[int] = ..., batches_per_shard: _Optional[int] = ..., epochs: _Optional[int] = ..., shuffle: _Optional[bool] = ..., seed: _Optional[int] = ..., mode: _Optional[_Union[DatasetSpec.DeliveryMode, str]] = ..., max_retries: _Optional[int] = ..., lease_s: _Optional[float] = ...) -> None: ...

class ShardId(_message.Message):
    __slots__ = ("epoch", "index")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    index: int
    def __init__(self, epoch: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

class Shard(_message.Message):
    __slots__ = ("dataset", "id", "start", "end", "offset", "shuffle", "seed", "attempt")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    id: ShardId
    start: int
    end: int
    offset: int
    shuffle: bool
    seed: int
    attempt: int
    def __init__(self, dataset: _Optional[str] = ..., id: _Optional[_Union[ShardId, _Mapping]] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., offset: _Optional[int] = ..., shuffle: _Optional[bool] = ..., seed: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class PendingShard(_message.Message):
    __slots__ = ("epoch", "index", "offset")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    index: int
    offset: int
    def __init__(self, epoch: _Optional[int] = ..., index: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class Position(_message.Message):
    __slots__ = ("dataset", "epoch", "cursor", "pending")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    epoch: int
    cursor: int
    pending: _containers.RepeatedCompositeFieldContainer[PendingShard]
    def __init__(self, dataset: _Optional[str] = ..., epoch: _Optional[int] = ..., cursor: _Optional[int] = ..., pending: _Optional[_Iterable[_Union[PendingShard, _Mapping]]] = ...) -> None: ...

class ConsumptionMark(_message.Message):
    __slots__ = ("epoch", "begin", "shard_id", "offset")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    begin: int
    shard_id: ShardId
    offset: int
    def __init__(self, epoch: _Optional[int] = ..., begin: _Optional[int] = ..., shard_id: _Optional[_Union[ShardId, _Mapping]] = ..., offset: _Optional[int] = ...) -> None: ...

class RegisterResult(_message.Message):
    __slots__ = ("dataset", "created")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    created: bool
    def __init__(self, dataset: _Optional[str] = ..., created: _Optional[bool] = ...) -> None: ...

class FetchResult(_message.Message):
    __slots__ = ("shards", "finished")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[Shard]
    finished: bool
    def __init__(self, shards: _Optional[_Iterable[_Union[Shard, _Mapping]]] = ..., finished: _Optional[bool] = ...) -> None: ...

class ReportResult(_message.Message):
    __slots__ = ("accepted", "ignored")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    IGNORED_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    ignored: int
    def __init__(self, accepted: _Optional[int] = ..., ignored: _Optional[int] = ...) -> None: ...

class PositionAt(_message.Message):
    __slots__ = ("position", "waiting_for")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    position: Position
    waiting_for: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, position: _Optional[_Union[Position, _Mapping]] = ..., waiting_for: _Optional[_Iterable[str]] = ...) -> None: ...

class DatasetProgress(_message.Message):
    __slots__ = ("dataset", "epoch", "todo", "leased", "done_shards", "finished", "lost_shards", "lost_samples")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TODO_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    DONE_SHARDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    LOST_SHARDS_FIELD_NUMBER: _ClassVar[int]
    LOST_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    epoch: int
    todo: int
    leased: int
    done_shards: int
    finished: bool
    lost_shards: int
    lost_samples: int
    def __init__(self, dataset: _Optional[str] = ..., epoch: _Optional[int] = ..., todo: _Optional[int] = ..., leased: _Optional[int] = ..., done_shards: _Optional[int] = ..., finished: _Optional[bool] = ..., lost_shards: _Optional[int] = ..., lost_samples: _Optional[int] = ...) -> None: ...

class RegisterDatasetRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: DatasetSpec
    def __init__(self, spec: _Optional[_Union[DatasetSpec, _Mapping]] = ...) -> None: ...

class RegisterDatasetResponse(_message.Message):
    __slots__ = ("error", "result", "refused")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    error: ShardingError
    result: RegisterResult
    refused: MasterError
    def __init__(self, error: _Optional[_Union[ShardingError, _Mapping]] = ..., result: _Optional[_Union[RegisterResult, _Mapping]] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class FetchShardsRequest(_message.Message):
    __slots__ = ("dataset", "worker_id", "max_count")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_COUNT_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    worker_id: str
    max_count: int
    def __init__(self, dataset: _Optional[str] = ..., worker_id: _Optional[str] = ..., max_count: _Optional[int] = ...) -> None: ...

class FetchShardsResponse(_message.Message):
    __slots__ = ("error", "result", "refused")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    error: ShardingError
    result: FetchResult
    refused: MasterError
    def __init__(self, error: _Optional[_Union[ShardingError, _Mapping]] = ..., result: _Optional[_Union[FetchResult, _Mapping]] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class ReportDoneRequest(_message.Message):
    __slots__ = ("dataset", "worker_id", "shard_ids")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_IDS_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    worker_id: str
    shard_ids: _containers.RepeatedCompositeFieldContainer[ShardId]
    def __init__(self, dataset: _Optional[str] = ..., worker_id: _Optional[str] = ..., shard_ids: _Optional[_Iterable[_Union[ShardId, _Mapping]]] = ...) -> None: ...

class ReportDoneResponse(_message.Message):
    __slots__ = ("error", "result", "refused")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    error: ShardingError
    result: ReportResult
    refused: MasterError
    def __init__(self, error: _Optional[_Union[ShardingError, _Mapping]] = ..., result: _Optional[_Union[ReportResult, _Mapping]] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class ReportProgressRequest(_message.Message):
    __slots__ = ("dataset", "worker_id", "shard_id", "consumed")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    worker_id: str
    shard_id: ShardId
    consumed: int
    def __init__(self, dataset: _Optional[str] = ..., worker_id: _Optional[str] = ..., shard_id: _Optional[_Union[ShardId, _Mapping]] = ..., consumed: _Optional[int] = ...) -> None: ...

class ReportProgressResponse(_message.Message):
    __slots__ = ("error", "accepted", "refused")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    error: ShardingError
    accepted: bool
    refused: MasterError
    def __init__(self, error: _Optional[_Union[ShardingError, _Mapping]] = ..., accepted: _Optional[bool] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class RenewLeasesRequest(_message.Message):
    __slots__ = ("dataset", "worker_id")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    worker_id: str
    def __init__(self, dataset: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...

class RenewLeasesResponse(_message.Message):
    __slots__ = ("error", "renewed", "refused")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    error: ShardingError
    renewed: int
    refused: MasterError
    def __init__(self, error: _Optional[_Union[ShardingError, _Mapping]] = ..., renewed: _Optional[int] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class GetPositionRequest(_message.Message):
    __slots__ = ("dataset",)
    DATASET_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    def __init__(self, dataset: _Optional[str] = ...) -> None: ...

class GetPositionResponse(_message.Message):
    __slots__ = ("error", "position", "refused")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    error: ShardingError
    position: Position
    refused: MasterError
    def __init__(self, error: _Optional[_Union[ShardingError, _Mapping]] = ..., position: _Optional[_Union[Position, _Mapping]] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class MarkConsumptionRequest(_message.Message):
    __slots__ = ("dataset", "worker_id", "mark")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MARK_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    worker_id: str
    mark: ConsumptionMark
    def __init__(self, dataset: _Optional[str] = ..., worker_id: _Optional[str] = ..., mark: _Optional[_Union[ConsumptionMark, _Mapping]] = ...) -> None: ...

class MarkConsumptionResponse(_message.Message):
    __slots__ = ("error", "refused")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    error: ShardingError
    refused: MasterError
    def __init__(self, error: _Optional[_Union[ShardingError, _Mapping]] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class PositionAtRequest(_message.Message):
    __slots__ = ("dataset", "epoch", "consumed")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    epoch: int
    consumed: int
    def __init__(self, dataset: _Optional[str] = ..., epoch: _Optional[int] = ..., consumed: _Optional[int] = ...) -> None: ...

class PositionAtResponse(_message.Message):
    __slots__ = ("error", "result", "refused")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    error: ShardingError
    result: PositionAt
    refused: MasterError
    def __init__(self, error: _Optional[_Union[ShardingError, _Mapping]] = ..., result: _Optional[_Union[PositionAt, _Mapping]] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class RestorePositionRequest(_message.Message):
    __slots__ = ("position", "token")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    position: Position
    token: str
    def __init__(self, position: _Optional[_Union[Position, _Mapping]] = ..., token: _Optional[str] = ...) -> None: ...

class RestorePositionResponse(_message.Message):
    __slots__ = ("error", "applied", "refused")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    error: ShardingError
    applied: bool
    refused: MasterError
    def __init__(self, error: _Optional[_Union[ShardingError, _Mapping]] = ..., applied: _Optional[bool] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class DatasetProgressRequest(_message.Message):
    __slots__ = ("dataset",)
    DATASET_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    def __init__(self, dataset: _Optional[str] = ...) -> None: ...

class DatasetProgressResponse(_message.Message):
    __slots__ = ("error", "result", "refused")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    error: ShardingError
    result: DatasetProgress
    refused: MasterError
    def __init__(self, error: _Optional[_Union[ShardingError, _Mapping]] = ..., result: _Optional[_Union[DatasetProgress, _Mapping]] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class PartitionOffset(_message.Message):
    __slots__ = ("partition", "offset")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    partition: int
    offset: int
    def __init__(self, partition: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class StreamSpec(_message.Message):
    __slots__ = ("name", "records_per_shard", "max_retries", "lease_s", "topic", "bootstrap_servers", "group_id", "end_offsets", "mode", "max_records_per_shard")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RECORDS_PER_SHARD_FIELD_NUMBER: _ClassVar[int]
    MAX_RETRIES_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_SERVERS_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    END_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_RECORDS_PER_SHARD_FIELD_NUMBER: _ClassVar[int]
    name: str
    records_per_shard: int
    max_retries: int
    lease_s: float
    topic: str
    bootstrap_servers: str
    group_id: str
    end_offsets: _containers.RepeatedCompositeFieldContainer[PartitionOffset]
    mode: DatasetSpec.DeliveryMode
    max_records_per_shard: int
    def __init__(self, name: _Optional[str] = ..., records_per_shard: _Optional[int] = ..., max_retries: _Optional[int] = ..., lease_s: _Optional[float] = ..., topic: _Optional[str] = ..., bootstrap_servers: _Optional[str] = ..., group_id: _Optional[str] = ..., end_offsets: _Optional[_Iterable[_Union[PartitionOffset, _Mapping]]] = ..., mode: _Optional[_Union[DatasetSpec.DeliveryMode, str]] = ..., max_records_per_shard: _Optional[int] = ...) -> None: ...

class StreamShard(_message.Message):
    __slots__ = ("stream", "partition", "start", "end", "attempt")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    stream: str
    partition: int
    start: int
    end: int
    attempt: int
    def __init__(self, stream: _Optional[str] = ..., partition: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class StreamRange(_message.Message):
    __slots__ = ("partition", "start", "end")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    partition: int
    start: int
    end: int
    def __init__(self, partition: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class StreamPosition(_message.Message):
    __slots__ = ("stream", "offsets", "pending")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    stream: str
    offsets: _containers.RepeatedCompositeFieldContainer[PartitionOffset]
    pending: _containers.RepeatedCompositeFieldContainer[StreamRange]
    def __init__(self, stream: _Optional[str] = ..., offsets: _Optional[_Iterable[_Union[PartitionOffset, _Mapping]]] = ..., pending: _Optional[_Iterable[_Union[StreamRange, _Mapping]]] = ...) -> None: ...

class StreamMark(_message.Message):
    __slots__ = ("begin", "partition", "start", "count", "attempt")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    begin: int
    partition: int
    start: int
    count: int
    attempt: int
    def __init__(self, begin: _Optional[int] = ..., partition: _Optional[int] = ..., start: _Optional[int] = ..., count: _Optional[int] = ..., attempt: _Optional[int] = ...) -> None: ...

class StreamFetchResult(_message.Message):
    __slots__ = ("shards", "finished")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    shards: _containers.RepeatedCompositeFieldContainer[StreamShard]
    finished: bool
    def __init__(self, shards: _Optional[_Iterable[_Union[StreamShard, _Mapping]]] = ..., finished: _Optional[bool] = ...) -> None: ...

class StreamPositionAt(_message.Message):
    __slots__ = ("position", "waiting_for")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    position: StreamPosition
    waiting_for: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, position: _Optional[_Union[StreamPosition, _Mapping]] = ..., waiting_for: _Optional[_Iterable[str]] = ...) -> None: ...

class StreamProgress(_message.Message):
    __slots__ = ("stream", "committed", "end_offsets", "leased", "stopped", "finished", "lost_records")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    END_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    LOST_RECORDS_FIELD_NUMBER: _ClassVar[int]
    stream: str
    committed: _containers.RepeatedCompositeFieldContainer[PartitionOffset]
    end_offsets: _containers.RepeatedCompositeFieldContainer[PartitionOffset]
    leased: int
    stopped: bool
    finished: bool
    lost_records: int
    def __init__(self, stream: _Optional[str] = ..., committed: _Optional[_Iterable[_Union[PartitionOffset, _Mapping]]] = ..., end_offsets: _Optional[_Iterable[_Union[PartitionOffset, _Mapping]]] = ..., leased: _Optional[int] = ..., stopped: _Optional[bool] = ..., finished: _Optional[bool] = ..., lost_records: _Optional[int] = ...) -> None: ...

class RegisterStreamRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: StreamSpec
    def __init__(self, spec: _Optional[_Union[StreamSpec, _Mapping]] = ...) -> None: ...

class RegisterStreamResponse(_message.Message):
    __slots__ = ("error", "result", "refused")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    error: ShardingError
    result: RegisterResult
    refused: MasterError
    def __init__(self, error: _Optional[_Union[ShardingError, _Mapping]] = ..., result: _Optional[_Union[RegisterResult, _Mapping]] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class FetchStreamShardsRequest(_message.Message):
    __slots__ = ("stream", "worker_id", "max_count")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_COUNT_FIELD_NUMBER: _ClassVar[int]
    stream: str
    worker_id: str
    max_count: int
    def __init__(self, stream: _Optional[str] = ..., worker_id: _Optional[str] = ..., max_count: _Optional[int] = ...) -> None: ...

class FetchStreamShardsResponse(_message.Message):
    __slots__ = ("error", "result", "refused")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    error: ShardingError
    result: StreamFetchResult
    refused: MasterError
    def __init__(self, error: _Optional[_Union[ShardingError, _Mapping]] = ..., result: _Optional[_Union[StreamFetchResult, _Mapping]] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class ReportStreamDoneRequest(_message.Message):
    __slots__ = ("stream", "worker_id", "shards")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    stream: str
    worker_id: str
    shards: _containers.RepeatedCompositeFieldContainer[StreamRange]
    def __init__(self, stream: _Optional[str] = ..., worker_id: _Optional[str] = ..., shards: _Optional[_Iterable[_Union[StreamRange, _Mapping]]] = ...) -> None: ...

class ReportStreamDoneResponse(_message.Message):
    __slots__ = ("error", "accepted", "refused")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    error: ShardingError
    accepted: int
    refused: MasterError
    def __init__(self, error: _Optional[_Union[ShardingError, _Mapping]] = ..., accepted: _Optional[int] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class StreamRemainder(_message.Message):
    __slots__ = ("partition", "start", "resume", "yielded")
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    YIELDED_FIELD_NUMBER: _ClassVar[int]
    partition: int
    start: int
    resume: int
    yielded: int
    def __init__(self, partition: _Optional[int] = ..., start: _Optional[int] = ..., resume: _Optional[int] = ..., yielded: _Optional[int] = ...) -> None: ...

class ReturnStreamShardsRequest(_message.Message):
    __slots__ = ("stream", "worker_id", "remainders")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REMAINDERS_FIELD_NUMBER: _ClassVar[int]
    stream: str
    worker_id: str
    remainders: _containers.RepeatedCompositeFieldContainer[StreamRemainder]
    def __init__(self, stream: _Optional[str] = ..., worker_id: _Optional[str] = ..., remainders: _Optional[_Iterable[_Union[StreamRemainder, _Mapping]]] = ...) -> None: ...

class RenewStreamLeasesRequest(_message.Message):
    __slots__ = ("stream", "worker_id")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    stream: str
    worker_id: str
    def __init__(self, stream: _Optional[str] = ..., worker_id: _Optional[str] = ...) -> None: ...

class MarkStreamRequest(_message.Message):
    __slots__ = ("stream", "worker_id", "mark")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MARK_FIELD_NUMBER: _ClassVar[int]
    stream: str
    worker_id: str
    mark: StreamMark
    def __init__(self, stream: _Optional[str] = ..., worker_id: _Optional[str] = ..., mark: _Optional[_Union[StreamMark, _Mapping]] = ...) -> None: ...

class MarkStreamRangesRequest(_message.Message):
    __slots__ = ("stream", "worker_id", "marks")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MARKS_FIELD_NUMBER: _ClassVar[int]
    stream: str
    worker_id: str
    marks: _containers.RepeatedCompositeFieldContainer[StreamMark]
    def __init__(self, stream: _Optional[str] = ..., worker_id: _Optional[str] = ..., marks: _Optional[_Iterable[_Union[StreamMark, _Mapping]]] = ...) -> None: ...

class MarkStreamRangesResponse(_message.Message):
    __slots__ = ("error", "accepted", "refused")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    error: ShardingError
    accepted: int
    refused: MasterError
    def __init__(self, error: _Optional[_Union[ShardingError, _Mapping]] = ..., accepted: _Optional[int] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class MarkStreamResponse(_message.Message):
    __slots__ = ("error", "accepted", "refused")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    error: ShardingError
    accepted: bool
    refused: MasterError
    def __init__(self, error: _Optional[_Union[ShardingError, _Mapping]] = ..., accepted: _Optional[bool] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class StreamPositionAtRequest(_message.Message):
    __slots__ = ("stream", "consumed")
    STREAM_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    stream: str
    consumed: int
    def __init__(self, stream: _Optional[str] = ..., consumed: _Optional[int] = ...) -> None: ...

class StreamPositionAtResponse(_message.Message):
    __slots__ = ("error", "result", "refused")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    error: ShardingError
    result: StreamPositionAt
    refused: MasterError
    def __init__(self, error: _Optional[_Union[ShardingError, _Mapping]] = ..., result: _Optional[_Union[StreamPositionAt, _Mapping]] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class RestoreStreamPositionRequest(_message.Message):
    __slots__ = ("position", "token")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    position: StreamPosition
    token: str
    def __init__(self, position: _Optional[_Union[StreamPosition, _Mapping]] = ..., token: _Optional[str] = ...) -> None: ...

class StreamProgressRequest(_message.Message):
    __slots__ = ("stream",)
    STREAM_FIELD_NUMBER: _ClassVar[int]
    stream: str
    def __init__(self, stream: _Optional[str] = ...) -> None: ...

class StreamProgressResponse(_message.Message):
    __slots__ = ("error", "result", "refused")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    error: ShardingError
    result: StreamProgress
    refused: MasterError
    def __init__(self, error: _Optional[_Union[ShardingError, _Mapping]] = ..., result: _Optional[_Union[StreamProgress, _Mapping]] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class CacheFile(_message.Message):
    __slots__ = ("name", "size", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    digest: str
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class CacheFilesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CacheFilesResponse(_message.Message):
    __slots__ = ("files", "refused")
    FILES_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    files: _containers.RepeatedCompositeFieldContainer[CacheFile]
    refused: MasterError
    def __init__(self, files: _Optional[_Iterable[_Union[CacheFile, _Mapping]]] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class CacheReadRequest(_message.Message):
    __slots__ = ("name", "offset", "length")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    length: int
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ...) -> None: ...

class CacheReadResponse(_message.Message):
    __slots__ = ("data", "refused")
    DATA_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    refused: MasterError
    def __init__(self, data: _Optional[bytes] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...

class CacheWriteRequest(_message.Message):
    __slots__ = ("name", "size", "digest", "offset", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    digest: str
    offset: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., digest: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class CacheWriteResponse(_message.Message):
    __slots__ = ("complete", "refused")
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    complete: bool
    refused: MasterError
    def __init__(self, complete: _Optional[bool] = ..., refused: _Optional[_Union[MasterError, _Mapping]] = ...) -> None: ...
