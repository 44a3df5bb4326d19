"""The overload bench's client: the chat API over raw HTTP/1.1 on asyncio streams, with a small
keep-alive pool. The bench's clients share the machine's cores with the stack they measure, and
they time what they read: httpx's per-request and per-line work (a large share of a core over an
overload phase) took CPU from the stack and delayed the reads being timed.

Only what the bench needs: a request with a JSON body; an answer with Content-Length or a
chunked body; SSE events cut at blank lines, each event's name and data read when it is whole."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

HEAD_END = b"\r\n\r\n"
MAX_HEAD_BYTES = 64 * 1024


class ProtocolError(Exception):
    """The server's answer is not HTTP/1.1 as the bench reads it."""


@dataclass
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    is_chunked: bool
    length: int | None


@dataclass
class Event:
    name: str
    data: bytes


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.is_reusable = False  # set once an answer was read to its end and the server did not ask to close

    @property
    def is_open(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()

    async def request(self, method: str, target: str, host: str, headers: dict[str, str], body: bytes) -> Answer:
        self.is_reusable = False
        lines = [f"{method} {target} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(body)}"]
        lines += [f"{name}: {value}" for name, value in headers.items()]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        try:
            head = await self.reader.readuntil(HEAD_END)
        except asyncio.LimitOverrunError as exc:
            raise ProtocolError("response head too long") from exc
        status_line, *header_lines = head[: -len(HEAD_END)].decode("latin-1").split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise ProtocolError(f"bad status line {status_line[:80]!r}")
        fields: dict[str, str] = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip()
        is_chunked = "chunked" in fields.get("transfer-encoding", "").lower()
        length = None if is_chunked or "content-length" not in fields else int(fields["content-length"])
        return Answer(int(parts[1]), fields, is_chunked, length)

    async def body(self, answer: Answer) -> bytes:
        """The whole body of an answer that has a length or is chunked."""
        if answer.is_chunked:
            return b"".join([chunk async for chunk in self.chunks(answer)])  # chunks() marks the connection at the end
        data = await (self.reader.read() if answer.length is None else self.reader.readexactly(answer.length))
        self._ended(answer)
        return data

    async def chunks(self, answer: Answer) -> AsyncIterator[bytes]:
        while True:
            size_line = await self.reader.readline()
            try:
                size = int(size_line.split(b";", 1)[0], 16)
            except ValueError as exc:
                raise ProtocolError(f"bad chunk size {size_line[:40]!r}") from exc
            if size == 0:
                await self.reader.readuntil(b"\r\n")  # no trailers expected: the last chunk's blank line
                self._ended(answer)
                return
            chunk = await self.reader.readexactly(size + 2)
            yield chunk[:-2]

    def _ended(self, answer: Answer) -> None:
        is_delimited = answer.length is not None or answer.is_chunked
        self.is_reusable = is_delimited and answer.headers.get("connection", "").lower() != "close"


async def connect(host: str, port: int) -> Connection:
    reader, writer = await asyncio.open_connection(host, port, limit=MAX_HEAD_BYTES)
    return Connection(reader, writer)


class Pool:
    """Keep-alive connections to one host, each carrying one request at a time."""

    def __init__(self, host: str, port: int, max_idle: int = 256) -> None:
        self.host, self.port, self._max_idle = host, port, max_idle
        self._idle: list[Connection] = []

    def give(self, connection: Connection) -> None:
        if connection.is_reusable and connection.is_open and len(self._idle) < self._max_idle:
            self._idle.append(connection)
        else:
            connection.close()

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()

    async def request(self, method: str, target: str, headers: dict[str, str], payload: object) -> tuple[Connection, Answer]:
        """Send on an idle connection, or a new one. An idle one the server closed meanwhile is
        replaced by a new one: nothing came back on it, so the server did not take the request."""
        body = json.dumps(payload).encode()
        host = f"{self.host}:{self.port}"
        fields = {**headers, "Content-Type": "application/json"}
        while self._idle:
            connection = self._idle.pop()
            if not connection.is_open:
                connection.close()
                continue
            try:
                return connection, await connection.request(method, target, host, fields, body)
            except (ConnectionError, asyncio.IncompleteReadError):
                connection.close()
                break
        connection = await connect(self.host, self.port)
        return connection, await connection.request(method, target, host, fields, body)


async def read_events(connection: Connection, answer: Answer, on_event: Callable[[Event], None]) -> None:
    """An SSE answer's events (comments skipped), each given to `on_event` when whole, until the
    body ends (the connection can then carry another request). The caller bounds the time
    (asyncio.timeout)."""
    pending = b""
    stream = connection.chunks(answer) if answer.is_chunked else _raw(connection.reader)
    async for chunk in stream:
        pending = (pending + chunk).replace(b"\r\n", b"\n")
        *whole, pending = pending.split(b"\n\n")
        for block in whole:
            name, data = "message", []
            for line in block.split(b"\n"):
                if line.startswith(b"event:"):
                    name = line[6:].strip().decode()
                elif line.startswith(b"data:"):
                    data.append(line[5:].removeprefix(b" "))
            if data:
                on_event(Event(name, b"\n".join(data)))


async def _raw(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while chunk := await reader.read(65536):
        yield chunk
