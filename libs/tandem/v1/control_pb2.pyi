from tandem.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthReply(_message.Message):
    __slots__ = ("status", "detail")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[HealthReply.Status]
        STATUS_SERVING: _ClassVar[HealthReply.Status]
        STATUS_NOT_SERVING: _ClassVar[HealthReply.Status]
    STATUS_UNSPECIFIED: HealthReply.Status
    STATUS_SERVING: HealthReply.Status
    STATUS_NOT_SERVING: HealthReply.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    status: HealthReply.Status
    detail: str
    def __init__(self, status: _Optional[_Union[HealthReply.Status, str]] = ..., detail: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("was_draining",)
    WAS_DRAINING_FIELD_NUMBER: _ClassVar[int]
    was_draining: bool
    def __init__(self, was_draining: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
