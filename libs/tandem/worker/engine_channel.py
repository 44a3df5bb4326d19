"""The worker's end of the socket to its engine process, on the event loop and never blocking it:
a message in is handed on once all its bytes have arrived, and a message out that the socket
cannot take yet waits in a buffer, in order, for the loop to say it can. The frames are
engine_wire's (multiprocessing.Connection's), which the engine process reads and writes blocking.
(Connection's own reads and writes here failed with BlockingIOError mid-message, taken for the
engine's death, once the event loop made the socket non-blocking, as uvloop's add_reader does.)"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from tandem.worker.engine_wire import ToEngine, ToWorker, frame, take_messages


class EngineChannel:
    def __init__(
        self,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop,
        on_message: Callable[[ToWorker], None],
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

    def send(self, message: ToEngine) -> None:
        """Pickled whole before a byte is buffered or written; raises OSError when the socket is
        broken (the engine process is gone)."""
        data = frame(message)
        if self._outbox:  # earlier messages wait: this one goes after them
            self._outbox += data
            return
        try:
            sent = self._sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            self._outbox += data[sent:]
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
                chunk = self._sock.recv(1 << 16)  # under malloc's mmap threshold, and far above a step's message
            except BlockingIOError:
                break
            except OSError as exc:
                self._fail(exc)
                return
            if not chunk:
                self._fail(EOFError("the engine process closed its socket"))
                return
            self._inbox += chunk
            for message in take_messages(self._inbox):
                self._on_message(message)

    def _fail(self, exc: BaseException) -> None:
        self.close()
        self._on_closed(exc)
