from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "user_id", "tenant", "conversation_id", "lane", "prompt_token_ids", "public_prefix_tokens", "sampling", "resume_reply_id", "generated_token_ids", "deadline_unix_ms", "reply_id", "epoch", "shadow_of")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_PREFIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    RESUME_REPLY_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REPLY_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SHADOW_OF_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    user_id: str
    tenant: str
    conversation_id: str
    lane: _common_pb2.Lane
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    public_prefix_tokens: int
    sampling: _common_pb2.SamplingParams
    resume_reply_id: str
    generated_token_ids: _containers.RepeatedScalarFieldContainer[int]
    deadline_unix_ms: int
    reply_id: str
    epoch: int
    shadow_of: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., user_id: _Optional[str] = ..., tenant: _Optional[str] = ..., conversation_id: _Optional[str] = ..., lane: _Optional[_Union[_common_pb2.Lane, str]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., public_prefix_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., resume_reply_id: _Optional[str] = ..., generated_token_ids: _Optional[_Iterable[int]] = ..., deadline_unix_ms: _Optional[int] = ..., reply_id: _Optional[str] = ..., epoch: _Optional[int] = ..., shadow_of: _Optional[str] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("reason", "message", "retry_after_s")
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    reason: str
    message: str
    retry_after_s: float
    def __init__(self, reason: _Optional[str] = ..., message: _Optional[str] = ..., retry_after_s: _Optional[float] = ...) -> None: ...

class GenerateReply(_message.Message):
    __slots__ = ("reply_id", "refused", "model", "shadow_model")
    REPLY_ID_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SHADOW_MODEL_FIELD_NUMBER: _ClassVar[int]
    reply_id: str
    refused: Refusal
    model: str
    shadow_model: str
    def __init__(self, reply_id: _Optional[str] = ..., refused: _Optional[_Union[Refusal, _Mapping]] = ..., model: _Optional[str] = ..., shadow_model: _Optional[str] = ...) -> None: ...
