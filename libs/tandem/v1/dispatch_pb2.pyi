from tandem.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Assignment(_message.Message):
    __slots__ = ("reply_id", "request", "first_seq", "decode_worker_id", "decode_grpc_address", "accept_by_unix_ms", "epoch")
    REPLY_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_BY_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    reply_id: str
    request: _generate_pb2.GenerateRequest
    first_seq: int
    decode_worker_id: str
    decode_grpc_address: str
    accept_by_unix_ms: int
    epoch: int
    def __init__(self, reply_id: _Optional[str] = ..., request: _Optional[_Union[_generate_pb2.GenerateRequest, _Mapping]] = ..., first_seq: _Optional[int] = ..., decode_worker_id: _Optional[str] = ..., decode_grpc_address: _Optional[str] = ..., accept_by_unix_ms: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class AssignmentReply(_message.Message):
    __slots__ = ("accepted", "refused", "failed_decode_worker_id")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    FAILED_DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    refused: _generate_pb2.Refusal
    failed_decode_worker_id: str
    def __init__(self, accepted: _Optional[bool] = ..., refused: _Optional[_Union[_generate_pb2.Refusal, _Mapping]] = ..., failed_decode_worker_id: _Optional[str] = ...) -> None: ...

class HandoffOutcome(_message.Message):
    __slots__ = ("reply_id", "result", "prefill_worker_id", "decode_worker_id", "reason", "message", "published_token_ids")
    class Result(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        RESULT_UNSPECIFIED: _ClassVar[HandoffOutcome.Result]
        RESULT_COMMITTED: _ClassVar[HandoffOutcome.Result]
        RESULT_ENDED: _ClassVar[HandoffOutcome.Result]
        RESULT_FAILED: _ClassVar[HandoffOutcome.Result]
    RESULT_UNSPECIFIED: HandoffOutcome.Result
    RESULT_COMMITTED: HandoffOutcome.Result
    RESULT_ENDED: HandoffOutcome.Result
    RESULT_FAILED: HandoffOutcome.Result
    REPLY_ID_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    reply_id: str
    result: HandoffOutcome.Result
    prefill_worker_id: str
    decode_worker_id: str
    reason: str
    message: str
    published_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, reply_id: _Optional[str] = ..., result: _Optional[_Union[HandoffOutcome.Result, str]] = ..., prefill_worker_id: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., published_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
