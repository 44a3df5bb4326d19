from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ServiceHeartbeat(_message.Message):
    __slots__ = ("role", "instance_id", "version", "http_url", "is_ready", "is_draining", "started_unix_ms", "sent_unix_ms", "interval_s")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HTTP_URL_FIELD_NUMBER: _ClassVar[int]
    IS_READY_FIELD_NUMBER: _ClassVar[int]
    IS_DRAINING_FIELD_NUMBER: _ClassVar[int]
    STARTED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    role: str
    instance_id: str
    version: str
    http_url: str
    is_ready: bool
    is_draining: bool
    started_unix_ms: int
    sent_unix_ms: int
    interval_s: float
    def __init__(self, role: _Optional[str] = ..., instance_id: _Optional[str] = ..., version: _Optional[str] = ..., http_url: _Optional[str] = ..., is_ready: _Optional[bool] = ..., is_draining: _Optional[bool] = ..., started_unix_ms: _Optional[int] = ..., sent_unix_ms: _Optional[int] = ..., interval_s: _Optional[float] = ...) -> None: ...

class WorkerHeartbeat(_message.Message):
    __slots__ = ("service", "model", "grpc_address", "ucx_address", "kv_blocks_free", "kv_blocks_total", "kv_block_size", "running", "waiting", "queued_prefill_tokens", "step_time_ms", "kv_event_id", "max_model_len", "is_engine_ready", "reply_ids", "prefill_tokens_per_s", "estimated_wait_s", "free_ttft_target_s")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    UCX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_MS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    IS_ENGINE_READY_FIELD_NUMBER: _ClassVar[int]
    REPLY_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    FREE_TTFT_TARGET_S_FIELD_NUMBER: _ClassVar[int]
    service: ServiceHeartbeat
    model: str
    grpc_address: str
    ucx_address: str
    kv_blocks_free: int
    kv_blocks_total: int
    kv_block_size: int
    running: _common_pb2.LaneCounts
    waiting: _common_pb2.LaneCounts
    queued_prefill_tokens: int
    step_time_ms: float
    kv_event_id: int
    max_model_len: int
    is_engine_ready: bool
    reply_ids: _containers.RepeatedScalarFieldContainer[str]
    prefill_tokens_per_s: float
    estimated_wait_s: float
    free_ttft_target_s: float
    def __init__(self, service: _Optional[_Union[ServiceHeartbeat, _Mapping]] = ..., model: _Optional[str] = ..., grpc_address: _Optional[str] = ..., ucx_address: _Optional[str] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., running: _Optional[_Union[_common_pb2.LaneCounts, _Mapping]] = ..., waiting: _Optional[_Union[_common_pb2.LaneCounts, _Mapping]] = ..., queued_prefill_tokens: _Optional[int] = ..., step_time_ms: _Optional[float] = ..., kv_event_id: _Optional[int] = ..., max_model_len: _Optional[int] = ..., is_engine_ready: _Optional[bool] = ..., reply_ids: _Optional[_Iterable[str]] = ..., prefill_tokens_per_s: _Optional[float] = ..., estimated_wait_s: _Optional[float] = ..., free_ttft_target_s: _Optional[float] = ...) -> None: ...

class LadderStatus(_message.Message):
    __slots__ = ("router_id", "rung", "busyness", "kv_occupancy", "queue_pressure", "sent_unix_ms", "interval_s")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    RUNG_FIELD_NUMBER: _ClassVar[int]
    BUSYNESS_FIELD_NUMBER: _ClassVar[int]
    KV_OCCUPANCY_FIELD_NUMBER: _ClassVar[int]
    QUEUE_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    rung: int
    busyness: float
    kv_occupancy: float
    queue_pressure: float
    sent_unix_ms: int
    interval_s: float
    def __init__(self, router_id: _Optional[str] = ..., rung: _Optional[int] = ..., busyness: _Optional[float] = ..., kv_occupancy: _Optional[float] = ..., queue_pressure: _Optional[float] = ..., sent_unix_ms: _Optional[int] = ..., interval_s: _Optional[float] = ...) -> None: ...

class RolloutStatus(_message.Message):
    __slots__ = ("router_id", "sent_unix_ms", "interval_s", "models")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    SENT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    sent_unix_ms: int
    interval_s: float
    models: _containers.RepeatedCompositeFieldContainer[ModelRollout]
    def __init__(self, router_id: _Optional[str] = ..., sent_unix_ms: _Optional[int] = ..., interval_s: _Optional[float] = ..., models: _Optional[_Iterable[_Union[ModelRollout, _Mapping]]] = ...) -> None: ...

class ModelRollout(_message.Message):
    __slots__ = ("model", "stable", "candidate", "configured_percent", "candidate_percent", "shadow_percent", "rolled_back", "rollback_reason", "rolled_back_unix_ms", "stable_window", "candidate_window")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STABLE_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_FIELD_NUMBER: _ClassVar[int]
    CONFIGURED_PERCENT_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_PERCENT_FIELD_NUMBER: _ClassVar[int]
    SHADOW_PERCENT_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_FIELD_NUMBER: _ClassVar[int]
    ROLLBACK_REASON_FIELD_NUMBER: _ClassVar[int]
    ROLLED_BACK_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    STABLE_WINDOW_FIELD_NUMBER: _ClassVar[int]
    CANDIDATE_WINDOW_FIELD_NUMBER: _ClassVar[int]
    model: str
    stable: str
    candidate: str
    configured_percent: float
    candidate_percent: float
    shadow_percent: float
    rolled_back: bool
    rollback_reason: str
    rolled_back_unix_ms: int
    stable_window: VersionWindow
    candidate_window: VersionWindow
    def __init__(self, model: _Optional[str] = ..., stable: _Optional[str] = ..., candidate: _Optional[str] = ..., configured_percent: _Optional[float] = ..., candidate_percent: _Optional[float] = ..., shadow_percent: _Optional[float] = ..., rolled_back: _Optional[bool] = ..., rollback_reason: _Optional[str] = ..., rolled_back_unix_ms: _Optional[int] = ..., stable_window: _Optional[_Union[VersionWindow, _Mapping]] = ..., candidate_window: _Optional[_Union[VersionWindow, _Mapping]] = ...) -> None: ...

class VersionWindow(_message.Message):
    __slots__ = ("replies", "errors", "ttft_p95_s")
    REPLIES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    TTFT_P95_S_FIELD_NUMBER: _ClassVar[int]
    replies: int
    errors: int
    ttft_p95_s: float
    def __init__(self, replies: _Optional[int] = ..., errors: _Optional[int] = ..., ttft_p95_s: _Optional[float] = ...) -> None: ...

class ReplyOutcome(_message.Message):
    __slots__ = ("reply_id", "model", "ttft_s", "is_error", "is_shadow", "finished_unix_ms")
    REPLY_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    IS_ERROR_FIELD_NUMBER: _ClassVar[int]
    IS_SHADOW_FIELD_NUMBER: _ClassVar[int]
    FINISHED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    reply_id: str
    model: str
    ttft_s: float
    is_error: bool
    is_shadow: bool
    finished_unix_ms: int
    def __init__(self, reply_id: _Optional[str] = ..., model: _Optional[str] = ..., ttft_s: _Optional[float] = ..., is_error: _Optional[bool] = ..., is_shadow: _Optional[bool] = ..., finished_unix_ms: _Optional[int] = ...) -> None: ...
