from tandem.v1 import generate_pb2 as _generate_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Assignment(_message.Message):
    __slots__ = ("reply_id", "request", "first_seq", "decode_worker_id", "decode_grpc_address")
    REPLY_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    reply_id: str
    request: _generate_pb2.GenerateRequest
    first_seq: int
    decode_worker_id: str
    decode_grpc_address: str
    def __init__(self, reply_id: _Optional[str] = ..., request: _Optional[_Union[_generate_pb2.GenerateRequest, _Mapping]] = ..., first_seq: _Optional[int] = ..., decode_worker_id: _Optional[str] = ..., decode_grpc_address: _Optional[str] = ...) -> None: ...

class AssignmentReply(_message.Message):
    __slots__ = ("accepted", "refused")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    refused: _generate_pb2.Refusal
    def __init__(self, accepted: _Optional[bool] = ..., refused: _Optional[_Union[_generate_pb2.Refusal, _Mapping]] = ...) -> None: ...
