"""Every message between a worker and its engine process (engine_process.py on the worker's side,
engine_core.py on the engine's), defined once, as vLLM's EngineCoreRequestType and SGLang's
io_struct.py define theirs: a kind each, and a frozen dataclass per kind.

To the engine process: `Start` (first, once), then `Call`, `Check` and `Cut`. To the worker:
`Ready` (once the engine is built), then `Change`, `Result`, and `Died` (last, when it can).

On the socket a message is pickled whole before a byte is written (a message that does not pickle
leaves the stream intact), in multiprocessing.Connection's frames: a 4-byte length, or -1 and an
8-byte one. Plain pickle, not Connection.send's: torch makes that one share a tensor's memory
through a file descriptor instead of copying it. The engine process reads and writes the frames
blocking (`send`, `receive`); the worker, on its event loop, never blocks (`frame`, `take_messages`)."""

from __future__ import annotations

import enum
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, ClassVar

from tandem.engine.block_pool import KvEvent
from tandem.engine.engine import Engine, EngineFacts, EngineStats, QueueWait, Request, RequestOutput
from tandem.worker.engine_spec import EngineSpec


class MessageKind(enum.Enum):
    START = "start"
    CALL = "call"
    CHECK = "check"
    CUT = "cut"
    READY = "ready"
    CHANGE = "change"
    RESULT = "result"
    DIED = "died"


# -- to the engine process ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Start:
    """The engine to build, and the engine process's log level."""

    kind: ClassVar[MessageKind] = MessageKind.START
    spec: EngineSpec
    log_level: str


@dataclass(frozen=True, slots=True)
class Call:
    """fn(engine) between two steps, in ticket order; a `Result` answers it when `wants_result`.
    `fn` travels pickled: a module-level function (engine_calls.py), or a functools.partial of one."""

    kind: ClassVar[MessageKind] = MessageKind.CALL
    ticket: int
    fn: Callable[[Engine], Any]
    wants_result: bool


@dataclass(frozen=True, slots=True)
class Check:
    """Engine.check(request), answered at once by a `Result`, beside the step in progress."""

    kind: ClassVar[MessageKind] = MessageKind.CHECK
    ticket: int
    request: Request


@dataclass(frozen=True, slots=True)
class Cut:
    """Engine.cut_step, beside the step in progress (after a paid request's add: the socket keeps their order)."""

    kind: ClassVar[MessageKind] = MessageKind.CUT


# -- to the worker --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    """The engine is built; its KV cache is in the memfd now."""

    kind: ClassVar[MessageKind] = MessageKind.READY
    facts: EngineFacts
    stats: EngineStats


@dataclass(frozen=True, slots=True)
class Change:
    """After a batch of calls or a step: its outputs, the fresh stats, how many calls (tickets) they
    include, and what the engine recorded since the last change."""

    kind: ClassVar[MessageKind] = MessageKind.CHANGE
    outputs: list[RequestOutput]
    stats: EngineStats
    num_applied: int
    kv_events: list[KvEvent]
    queue_waits: list[QueueWait]


@dataclass(frozen=True, slots=True)
class Result:
    """What the call or check with `ticket` returned (`result`) or raised (`exc`)."""

    kind: ClassVar[MessageKind] = MessageKind.RESULT
    ticket: int
    result: object
    exc: BaseException | None


@dataclass(frozen=True, slots=True)
class Died:
    """What ended the engine process (the exception, or its words when it does not pickle)."""

    kind: ClassVar[MessageKind] = MessageKind.DIED
    exc: BaseException


ToEngine = Start | Call | Check | Cut
ToWorker = Ready | Change | Result | Died


# -- the engine process's side: blocking --------------------------------------------------------


def send(conn: Connection, message: ToWorker) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> ToEngine:
    message = pickle.loads(conn.recv_bytes())
    if not isinstance(message, ToEngine):
        raise TypeError(f"not a message to the engine process: {type(message).__name__}")
    return message


# -- the worker's side: the event loop's, never blocking ----------------------------------------


def frame(message: ToEngine) -> bytes:
    """The message's frame, pickled whole before a byte is written."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    header = struct.pack("!i", len(data)) if len(data) <= 0x7FFFFFFF else struct.pack("!iQ", -1, len(data))
    return header + data


def take_messages(inbox: bytearray) -> list[ToWorker]:
    """Every message whose frame has arrived whole, removed from the front of `inbox`; a part of a
    frame stays there for the bytes still to come."""
    messages: list[ToWorker] = []
    start = 0
    while len(inbox) - start >= 4:
        (size,) = struct.unpack_from("!i", inbox, start)
        header = 4
        if size == -1:
            if len(inbox) - start < 12:
                break
            (size,) = struct.unpack_from("!Q", inbox, start + 4)
            header = 12
        if len(inbox) - start < header + size:
            break
        message = pickle.loads(inbox[start + header : start + header + size])
        if not isinstance(message, ToWorker):
            raise TypeError(f"not a message to the worker: {type(message).__name__}")
        messages.append(message)
        start += header + size
    del inbox[:start]
    return messages
