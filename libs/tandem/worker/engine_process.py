"""An Engine in a process of its own (engine_core.py), driven from the worker's asyncio loop over a
socket pair: the CPU worker's default (TANDEM_ENGINE_PROCESS). In one process the engine thread and
the event loop share one GIL, and every token the loop publishes delays the engine's next kernel
launch; here the engine never waits for the loop, as in vLLM's engine core and SGLang's scheduler
process.

The surface is EngineThread's: `call` and `post` run a function on the engine between two steps
(in order, by ticket); each step's outputs, the fresh stats and what the engine recorded (its KV
events, its queue waits) come back as one message to `on_change` and `on_outputs`; `check` answers
at once, beside a step in progress. The functions and their arguments travel pickled, so they are
module-level functions (functools.partial of them), not closures.

The KV cache lives in a memfd that both processes map, so the worker reads and writes a handoff's
blocks (`block_view`) without a copy through the socket. The engine process ignores SIGINT and
SIGTERM (the worker drains on them, and the engine must serve the drain) and ends when its socket
closes: at `stop`, or when the worker dies however it dies. Its death (a crash, kill -9, a failed
load) is the worker's `on_death`, as the engine thread's is."""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from tandem.engine.block_pool import KvEvent
from tandem.engine.engine import Engine, EngineFacts, EngineStats, QueueWait, Request, RequestOutput
from tandem.worker.engine_core import map_kv_cache
from tandem.worker.thread import EngineDead, EngineDriver

log = logging.getLogger(__name__)

T = TypeVar("T")
OnChange = Callable[[EngineStats, list[KvEvent], list[QueueWait]], None]


class _Channel:
    """The worker's end of the socket to the engine process, on the event loop and never blocking
    it: a message in is handed on once all its bytes have arrived, and a message out that the
    socket cannot take yet waits in a buffer, in order, for the loop to say it can. The frames are
    multiprocessing.Connection's (a 4-byte length, or -1 and an 8-byte one), which the engine
    process reads and writes blocking. (Connection's own reads and writes here failed with
    BlockingIOError mid-message, taken for the engine's death, once the event loop made the socket
    non-blocking, as uvloop's add_reader does.)"""

    def __init__(
        self,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[Any], None],
        on_closed: Callable[[BaseException], None],
    ) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._loop = loop
        self._on_message = on_message
        self._on_closed = on_closed
        self._inbox = bytearray()
        self._outbox = bytearray()
        self.closed = False
        loop.add_reader(sock.fileno(), self._on_readable)

    def send(self, message: tuple[Any, ...]) -> None:
        """Pickled whole before a byte is buffered or written; raises OSError when the socket is
        broken (the engine process is gone)."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        header = struct.pack("!i", len(data)) if len(data) <= 0x7FFFFFFF else struct.pack("!iQ", -1, len(data))
        frame = header + data
        if self._outbox:  # earlier messages wait: this one goes after them
            self._outbox += frame
            return
        try:
            sent = self._sock.send(frame)
        except BlockingIOError:
            sent = 0
        if sent < len(frame):
            self._outbox += frame[sent:]
            self._loop.add_writer(self._sock.fileno(), self._on_writable)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._loop.remove_reader(self._sock.fileno())
            self._loop.remove_writer(self._sock.fileno())
            self._sock.close()

    def _on_writable(self) -> None:
        try:
            sent = self._sock.send(self._outbox)
        except BlockingIOError:
            return
        except OSError as exc:
            self._fail(exc)
            return
        del self._outbox[:sent]
        if not self._outbox:
            self._loop.remove_writer(self._sock.fileno())

    def _on_readable(self) -> None:
        while not self.closed:
            try:
                chunk = self._sock.recv(1 << 16)  # under malloc's mmap threshold: a step's message is a few kB
            except BlockingIOError:
                break
            except OSError as exc:
                self._fail(exc)
                return
            if not chunk:
                self._fail(EOFError("the engine process closed its socket"))
                return
            self._inbox += chunk
            for message in self._whole_messages():
                self._on_message(message)

    def _whole_messages(self) -> list[Any]:
        messages, start, inbox = [], 0, self._inbox
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
            messages.append(pickle.loads(inbox[start + header : start + header + size]))
            start += header + size
        del inbox[:start]
        return messages

    def _fail(self, exc: BaseException) -> None:
        self.close()
        self._on_closed(exc)


class EngineProcess(EngineDriver):
    def __init__(
        self,
        spec: object,
        on_outputs: Callable[[list[RequestOutput]], None],
        loop: asyncio.AbstractEventLoop,
        on_change: OnChange = lambda stats, events, waits: None,
        on_death: Callable[[BaseException], None] = lambda exc: None,
        log_level: str = "INFO",
    ) -> None:
        """`spec`: the EngineSpec the engine process builds its engine from (tandem.worker.host.build_engine)."""
        super().__init__()
        self._spec = spec
        self._on_outputs = on_outputs
        self._loop = loop
        self._on_change = on_change
        self._on_death = on_death
        self._log_level = log_level
        self._num_posted = 0
        self._facts: EngineFacts | None = None
        self._kv_cache: torch.Tensor | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._channel: _Channel | None = None
        self._kv_fd: int | None = None
        self._child: subprocess.Popen[bytes] | None = None

    @property
    def is_ready(self) -> bool:
        return self._facts is not None and self._death is None

    @property
    def pid(self) -> int | None:
        """The engine process's, once started."""
        return None if self._child is None else self._child.pid

    @property
    def exit_code(self) -> int | None:
        """The engine process's, once it has ended (and been waited for); None before."""
        return None if self._child is None else self._child.returncode

    @property
    def facts(self) -> EngineFacts:
        if self._facts is None:
            raise RuntimeError("the engine is not loaded yet")
        return self._facts

    def block_view(self, block_id: int) -> torch.Tensor:
        """One block of the shared KV cache, as Engine.block_view gives it in the engine process."""
        if self._kv_cache is None:
            raise RuntimeError("the engine is not loaded yet")
        return self._kv_cache[block_id]

    def start(self) -> None:
        ours, theirs = socket.socketpair()
        self._kv_fd = os.memfd_create("tandem-kv-cache")
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-m", "tandem.worker.engine_core", str(theirs.fileno()), str(self._kv_fd)],
                pass_fds=(theirs.fileno(), self._kv_fd),
            )
        finally:
            theirs.close()
        self._channel = _Channel(ours, self._loop, self._handle, self._on_closed)
        self._send((self._spec, self._log_level))

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Runs fn(engine) in the engine process before its next step; returns or raises what fn does."""
        if self._death is not None:
            raise EngineDead("the engine process has died") from self._death
        return await self._ask("call", fn)

    def post(self, fn: Callable[[Engine], object]) -> int:
        """Like `call`, without waiting (an abort, a release); returns its ticket."""
        self._num_posted += 1
        if self._death is None:
            self._send(("call", self._num_posted, fn, False))
        return self._num_posted

    def cut_step(self) -> None:
        """Engine.cut_step in the engine process, beside the step in progress (after posting a
        paid request's add: the socket keeps their order)."""
        if self._death is None:
            self._send(("cut",))

    async def check(self, request: Request) -> None:
        """Engine.check in the engine process, answered beside the step in progress."""
        if self._death is not None:
            raise EngineDead("the engine process has died") from self._death
        await self._ask("check", request)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Closes the socket (the engine process ends after its step in progress) and waits for it."""
        if self._channel is not None:
            self._channel.close()
        if self._kv_fd is not None:
            os.close(self._kv_fd)
            self._kv_fd = None
        if self._child is not None:
            try:
                self._child.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("the engine process did not end within %.0f s of its stop; killing it", timeout_s)
                self._child.kill()
                self._child.wait()

    # -- internals ------------------------------------------------------------------------------

    async def _ask(self, kind: str, what: object) -> Any:
        self._num_posted += 1
        done = self._loop.create_future()
        self._pending[self._num_posted] = done
        self._send((kind, self._num_posted, what, True))
        return await done

    def _send(self, message: tuple[Any, ...]) -> None:
        assert self._channel is not None
        try:
            self._channel.send(message)
        except OSError as exc:  # the engine process is gone; its EOF tells the reader too
            self._die(EngineDead(f"the engine process is gone: {type(exc).__name__}"))

    def _on_closed(self, exc: BaseException) -> None:
        code = self._child.poll() if self._child is not None else None
        self._die(EngineDead(f"the engine process ended ({type(exc).__name__}, exit code {code})"))

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "change":
            _, outputs, stats, num_applied, events, waits = message
            self._snapshot = (stats, num_applied)
            self._on_change(stats, events, waits)
            if outputs:
                self._on_outputs(outputs)
        elif kind == "result":
            _, ticket, result, exc = message
            done = self._pending.pop(ticket, None)
            if done is not None and not done.done():
                if exc is None:
                    done.set_result(result)
                else:
                    done.set_exception(exc)
        elif kind == "ready":
            _, facts, stats = message
            self._kv_cache = _map_kv_cache(self._kv_fd, facts)
            self._facts = facts
            self._snapshot = (stats, 0)
        elif kind == "died":
            self._die(message[1])

    def _die(self, exc: BaseException) -> None:
        if self._death is not None:
            return
        self._death = exc
        pending, self._pending = self._pending, {}
        for done in pending.values():
            if not done.done():
                dead = EngineDead("the engine process has died")
                dead.__cause__ = exc
                done.set_exception(dead)
        self._on_death(exc)


def _map_kv_cache(fd: int | None, facts: EngineFacts) -> torch.Tensor:
    """The engine process's KV cache, mapped from the memfd it sized."""
    assert fd is not None
    return map_kv_cache(fd, facts.kv_cache_shape, facts.kv_dtype)
