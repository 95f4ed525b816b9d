from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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
    __slots__ = ("node_id", "incarnation", "config")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    config: JobConfig
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., config: _Optional[_Union[JobConfig, _Mapping]] = ...) -> None: ...

class ResourceUsage(_message.Message):
    __slots__ = ("cpu_percent", "memory_bytes")
    CPU_PERCENT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    cpu_percent: float
    memory_bytes: int
    def __init__(self, cpu_percent: _Optional[float] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("node_id", "incarnation", "usage", "step", "worker_state", "restart_count")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORKER_STATE_FIELD_NUMBER: _ClassVar[int]
    RESTART_COUNT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    usage: ResourceUsage
    step: int
    worker_state: str
    restart_count: int
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., usage: _Optional[_Union[ResourceUsage, _Mapping]] = ..., step: _Optional[int] = ..., worker_state: _Optional[str] = ..., restart_count: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("action", "job_state")
    ACTION_FIELD_NUMBER: _ClassVar[int]
    JOB_STATE_FIELD_NUMBER: _ClassVar[int]
    action: str
    job_state: str
    def __init__(self, action: _Optional[str] = ..., job_state: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("round",)
    ROUND_FIELD_NUMBER: _ClassVar[int]
    round: int
    def __init__(self, round: _Optional[int] = ...) -> None: ...

class GetCommWorldRequest(_message.Message):
    __slots__ = ("node_id", "round")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    round: int
    def __init__(self, node_id: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class WorldMember(_message.Message):
    __slots__ = ("node_id", "node_rank", "local_world_size", "host")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    node_rank: int
    local_world_size: int
    host: str
    def __init__(self, node_id: _Optional[str] = ..., node_rank: _Optional[int] = ..., local_world_size: _Optional[int] = ..., host: _Optional[str] = ...) -> None: ...

class CommWorld(_message.Message):
    __slots__ = ("round", "complete", "members", "node_rank", "world_size", "rank_offset", "store_host", "store_port", "excluded", "message")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    round: int
    complete: bool
    members: _containers.RepeatedCompositeFieldContainer[WorldMember]
    node_rank: int
    world_size: int
    rank_offset: int
    store_host: str
    store_port: int
    excluded: bool
    message: str
    def __init__(self, round: _Optional[int] = ..., complete: _Optional[bool] = ..., members: _Optional[_Iterable[_Union[WorldMember, _Mapping]]] = ..., node_rank: _Optional[int] = ..., world_size: _Optional[int] = ..., rank_offset: _Optional[int] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., excluded: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class NumNodesWaitingRequest(_message.Message):
    __slots__ = ("node_id", "round")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    round: int
    def __init__(self, node_id: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class NumNodesWaitingResponse(_message.Message):
    __slots__ = ("waiting", "latest_round")
    WAITING_FIELD_NUMBER: _ClassVar[int]
    LATEST_ROUND_FIELD_NUMBER: _ClassVar[int]
    waiting: int
    latest_round: int
    def __init__(self, waiting: _Optional[int] = ..., latest_round: _Optional[int] = ...) -> None: ...

class KvSetRequest(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class KvSetResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvGetRequest(_message.Message):
    __slots__ = ("key", "wait_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    key: str
    wait_s: float
    def __init__(self, key: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class KvGetResponse(_message.Message):
    __slots__ = ("found", "value")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    found: bool
    value: bytes
    def __init__(self, found: _Optional[bool] = ..., value: _Optional[bytes] = ...) -> None: ...

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
    __slots__ = ()
    def __init__(self) -> None: ...

class ReportNodeStatusRequest(_message.Message):
    __slots__ = ("node_id", "incarnation", "status", "exit_code", "reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    incarnation: int
    status: str
    exit_code: int
    reason: str
    def __init__(self, node_id: _Optional[str] = ..., incarnation: _Optional[int] = ..., status: _Optional[str] = ..., exit_code: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ReportNodeStatusResponse(_message.Message):
    __slots__ = ("job_done",)
    JOB_DONE_FIELD_NUMBER: _ClassVar[int]
    job_done: bool
    def __init__(self, job_done: _Optional[bool] = ...) -> None: ...

class GetJobStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "state", "node_rank", "host", "step", "restart_count", "last_heartbeat_age_s", "role", "cpu_percent", "memory_bytes")
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
    def __init__(self, node_id: _Optional[str] = ..., state: _Optional[str] = ..., node_rank: _Optional[int] = ..., host: _Optional[str] = ..., step: _Optional[int] = ..., restart_count: _Optional[int] = ..., last_heartbeat_age_s: _Optional[float] = ..., role: _Optional[str] = ..., cpu_percent: _Optional[float] = ..., memory_bytes: _Optional[int] = ...) -> None: ...

class JobStatus(_message.Message):
    __slots__ = ("job_name", "state", "round", "nodes", "reason", "exit_code")
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    job_name: str
    state: str
    round: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    reason: str
    exit_code: int
    def __init__(self, job_name: _Optional[str] = ..., state: _Optional[str] = ..., round: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., reason: _Optional[str] = ..., exit_code: _Optional[int] = ...) -> None: ...

class ShardingRequest(_message.Message):
    __slots__ = ("method", "args_json")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    method: str
    args_json: bytes
    def __init__(self, method: _Optional[str] = ..., args_json: _Optional[bytes] = ...) -> None: ...

class ShardingResponse(_message.Message):
    __slots__ = ("result_json",)
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    result_json: bytes
    def __init__(self, result_json: _Optional[bytes] = ...) -> None: ...

class StopJobRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("committer",)
    COMMITTER_FIELD_NUMBER: _ClassVar[int]
    committer: bool
    def __init__(self, committer: _Optional[bool] = ...) -> None: ...

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
    __slots__ = ("committed",)
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    committed: bool
    def __init__(self, committed: _Optional[bool] = ...) -> None: ...

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
    __slots__ = ("decided", "step")
    DECIDED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    decided: bool
    step: int
    def __init__(self, decided: _Optional[bool] = ..., step: _Optional[int] = ...) -> None: ...
