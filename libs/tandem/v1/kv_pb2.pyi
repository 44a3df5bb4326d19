from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StoredBlock(_message.Message):
    __slots__ = ("block_hash", "parent_hash", "num_tokens")
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    block_hash: int
    parent_hash: int
    num_tokens: int
    def __init__(self, block_hash: _Optional[int] = ..., parent_hash: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class BlocksStored(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[StoredBlock]
    def __init__(self, blocks: _Optional[_Iterable[_Union[StoredBlock, _Mapping]]] = ...) -> None: ...

class BlocksRemoved(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("worker_id", "event_id", "stored", "removed", "cleared")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    event_id: int
    stored: BlocksStored
    removed: BlocksRemoved
    cleared: AllBlocksCleared
    def __init__(self, worker_id: _Optional[str] = ..., event_id: _Optional[int] = ..., stored: _Optional[_Union[BlocksStored, _Mapping]] = ..., removed: _Optional[_Union[BlocksRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class KvStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvState(_message.Message):
    __slots__ = ("worker_id", "event_id", "blocks")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    event_id: int
    blocks: _containers.RepeatedCompositeFieldContainer[StoredBlock]
    def __init__(self, worker_id: _Optional[str] = ..., event_id: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[StoredBlock, _Mapping]]] = ...) -> None: ...
