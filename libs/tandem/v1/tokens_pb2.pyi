from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenEvent(_message.Message):
    __slots__ = ("reply_id", "seq", "token_id", "text", "finish", "usage", "error", "worker_id", "produced_unix_ms", "epoch", "model", "logprob", "top_logprobs", "stop_reason")
    REPLY_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    reply_id: str
    seq: int
    token_id: int
    text: str
    finish: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    error: _common_pb2.Error
    worker_id: str
    produced_unix_ms: int
    epoch: int
    model: str
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    stop_reason: str
    def __init__(self, reply_id: _Optional[str] = ..., seq: _Optional[int] = ..., token_id: _Optional[int] = ..., text: _Optional[str] = ..., finish: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., error: _Optional[_Union[_common_pb2.Error, _Mapping]] = ..., worker_id: _Optional[str] = ..., produced_unix_ms: _Optional[int] = ..., epoch: _Optional[int] = ..., model: _Optional[str] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., stop_reason: _Optional[str] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("worker_id", "events")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    events: _containers.RepeatedCompositeFieldContainer[TokenEvent]
    def __init__(self, worker_id: _Optional[str] = ..., events: _Optional[_Iterable[_Union[TokenEvent, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ("reply_id", "reason")
    REPLY_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    reply_id: str
    reason: str
    def __init__(self, reply_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...
