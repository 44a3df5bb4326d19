from tandem.v1 import dispatch_pb2 as _dispatch_pb2
from tandem.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvLayout(_message.Message):
    __slots__ = ("model", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "byte_order", "tensor_parallel_size")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BYTE_ORDER_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    byte_order: str
    tensor_parallel_size: int
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., byte_order: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("reply_id", "layout", "num_blocks", "request")
    REPLY_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    reply_id: str
    layout: KvLayout
    num_blocks: int
    request: _generate_pb2.GenerateRequest
    def __init__(self, reply_id: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., num_blocks: _Optional[int] = ..., request: _Optional[_Union[_generate_pb2.GenerateRequest, _Mapping]] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("block_ids", "ucx_host", "ucx_port", "lease_s", "num_cached_blocks", "transfer_token")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    UCX_HOST_FIELD_NUMBER: _ClassVar[int]
    UCX_PORT_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    ucx_host: str
    ucx_port: int
    lease_s: float
    num_cached_blocks: int
    transfer_token: bytes
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., ucx_host: _Optional[str] = ..., ucx_port: _Optional[int] = ..., lease_s: _Optional[float] = ..., num_cached_blocks: _Optional[int] = ..., transfer_token: _Optional[bytes] = ...) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("reservation", "refused")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    reservation: Reservation
    refused: _generate_pb2.Refusal
    def __init__(self, reservation: _Optional[_Union[Reservation, _Mapping]] = ..., refused: _Optional[_Union[_generate_pb2.Refusal, _Mapping]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("reply_id", "assignment", "first_token_id", "num_cached_tokens")
    REPLY_ID_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reply_id: str
    assignment: _dispatch_pb2.Assignment
    first_token_id: int
    num_cached_tokens: int
    def __init__(self, reply_id: _Optional[str] = ..., assignment: _Optional[_Union[_dispatch_pb2.Assignment, _Mapping]] = ..., first_token_id: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("accepted", "refused")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    refused: _generate_pb2.Refusal
    def __init__(self, accepted: _Optional[bool] = ..., refused: _Optional[_Union[_generate_pb2.Refusal, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("reply_id",)
    REPLY_ID_FIELD_NUMBER: _ClassVar[int]
    reply_id: str
    def __init__(self, reply_id: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("was_reserved",)
    WAS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    was_reserved: bool
    def __init__(self, was_reserved: _Optional[bool] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("reply_id",)
    REPLY_ID_FIELD_NUMBER: _ClassVar[int]
    reply_id: str
    def __init__(self, reply_id: _Optional[str] = ...) -> None: ...

class RenewReply(_message.Message):
    __slots__ = ("is_reserved", "lease_s")
    IS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    is_reserved: bool
    lease_s: float
    def __init__(self, is_reserved: _Optional[bool] = ..., lease_s: _Optional[float] = ...) -> None: ...
