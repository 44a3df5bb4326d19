"""The stream bench's client processes: thousands of SSE streams per process, each a raw-socket
HTTP/1.1 connection (an asyncio Protocol with its own small chunked and SSE parser, which takes
each read's whole events at once: counted, id-checked and hashed in C, not one by one), so one
process holds many streams cheaply and the client is not the bottleneck.

A process gets a job over a pipe, opens its streams, reads them to `done` (a stream that ends
early resumes with Last-Event-ID, as a browser does), and answers with one small summary per
stream; then, given when the relay wrote each event, the delays of the events it received live.
The capacity job only opens its streams, counts the answers, and closes them all."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import resource
import time
import zlib
from array import array
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import Synchronized
from typing import Any, cast

import uvloop

MAX_RESUMES = 20
DELAY_BIN_MS = 1
MAX_DELAY_MS = 120_000
EVENT_END = b"\r\n\r\n"  # sse-starlette's separator, twice
COMMENT = re.compile(rb"(?m)^:[^\r\n]*\r\n\r\n")
ID_LINE = re.compile(rb"(?m)^id: (\d+)\r$")
FINAL_EVENT = b"\r\nevent: done\r\n"
ERROR_EVENT = b"\r\nevent: error\r\n"


@dataclass
class Job:
    host: str
    port: int
    api_key: str
    reply_ids: list[str]  # one stream per entry
    mode: str = "read"  # "read": read to done; "capacity": open, count answers, close
    max_connecting: int = 128  # connections opened but not yet answered, at once
    timeout_s: float = 600.0  # after the last stream was asked for, the streams still open are closed


@dataclass
class StreamResult:
    reply_id: str
    status: int = 0  # of the first request; 0: no HTTP answer (refused, reset)
    error_code: str = ""
    has_retry_after: bool = False
    num_events: int = 0
    is_done: bool = False  # saw `done` or `error`
    is_contiguous: bool = True  # ids 1, 2, 3, ... across resumes
    chain: int = 0  # crc32 over the log-derived events' bytes (id >= 2)
    num_resumes: int = 0
    num_server_ends: int = 0  # answered 200, then ended before `done` and before the client closed it
    requested_s: float = 0.0  # when its first request was written (unix time)
    attached_s: float = 0.0  # when its first answer's head arrived (unix time)
    arrivals_s: array = field(default_factory=lambda: array("d"))  # arrival of event id k at index k - 1


class SseStream(asyncio.Protocol):
    """One request on one connection: the response head, then a chunked SSE body (or a small
    JSON error body with Content-Length)."""

    def __init__(
        self, job: Job, result: StreamResult, last_event_id: int, on_answer: Callable[[], None], on_end: Callable[[SseStream], None]
    ) -> None:
        self._job, self.result, self._last_event_id = job, result, last_event_id
        self._on_answer, self._on_end = on_answer, on_end
        self._head = bytearray()
        self._is_body = False
        self._raw = bytearray()
        self._chunk_left = 0
        self._need_crlf = False
        self._content_length: int | None = None
        self._pending = bytearray()  # the part of an event received so far
        self.transport: asyncio.Transport | None = None
        self.status = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # TCP (uvloop's class is not asyncio.Transport's subclass)
        resume = f"Last-Event-ID: {self._last_event_id}\r\n" if self._last_event_id else ""
        request = (
            f"GET /v1/messages/{self.result.reply_id}/stream HTTP/1.1\r\nHost: {self._job.host}:{self._job.port}\r\n"
            f"Authorization: Bearer {self._job.api_key}\r\nAccept: text/event-stream\r\nConnection: close\r\n{resume}\r\n"
        )
        transport.write(request.encode())
        if not self.result.requested_s:
            self.result.requested_s = time.time()

    def data_received(self, data: bytes) -> None:
        now_s = time.time()
        if not self._is_body:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                return
            rest = bytes(self._head[end + 4 :])
            self._read_head(bytes(self._head[:end]).decode("latin-1"), now_s)
            self._is_body = True
            data = rest
        if self._content_length is not None:
            self._raw += data
            if len(self._raw) >= self._content_length:
                self._read_error_body()
                self.close()
            return
        self._feed_chunked(data, now_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._on_end(self)

    def close(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def _read_head(self, head: str, now_s: float) -> None:
        status_line, *header_lines = head.split("\r\n")
        self.status = int(status_line.split(" ", 2)[1])
        headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in header_lines)}
        if self.result.status == 0:
            self.result.status = self.status
            self.result.has_retry_after = "retry-after" in headers
            self.result.attached_s = now_s
        if "content-length" in headers and headers.get("transfer-encoding") != "chunked":
            self._content_length = int(headers["content-length"])
        self._on_answer()

    def _read_error_body(self) -> None:
        try:
            body: Any = json.loads(bytes(self._raw[: self._content_length]))
            self.result.error_code = str(body["error"]["code"])
        except (ValueError, KeyError, TypeError):
            self.result.error_code = "unreadable"

    def _feed_chunked(self, data: bytes, now_s: float) -> None:
        raw = self._raw
        raw += data
        while raw:
            if self._need_crlf:
                if len(raw) < 2:
                    return
                del raw[:2]
                self._need_crlf = False
            elif self._chunk_left == 0:
                end = raw.find(b"\r\n")
                if end < 0:
                    return
                size = int(bytes(raw[:end]).split(b";")[0], 16)
                del raw[: end + 2]
                if size == 0:
                    self.close()
                    return
                self._chunk_left = size
            else:
                piece = bytes(raw[: self._chunk_left])
                del raw[: len(piece)]
                self._chunk_left -= len(piece)
                self._need_crlf = self._chunk_left == 0
                self._feed_sse(piece, now_s)

    def _feed_sse(self, piece: bytes, now_s: float) -> None:
        """Whole events only, in bulk (a late stream gets a reply's whole past in one chunk): the
        comments (keep-alives) left out, the rest counted, checked for contiguous ids, and added
        byte for byte to the stream's chain."""
        self._pending += piece
        end = self._pending.rfind(EVENT_END)
        if end < 0:
            return
        blob = bytes(self._pending[: end + len(EVENT_END)])
        del self._pending[: end + len(EVENT_END)]
        if blob.startswith(b":") or b"\n:" in blob:
            blob = COMMENT.sub(b"", blob)
        if not blob:
            return
        result = self.result
        if result.num_events == 0:  # a stream's first event is its `meta`, not from the log
            cut = blob.find(EVENT_END) + len(EVENT_END)
            self._count(blob[:cut], now_s)
            blob = blob[cut:]
            if not blob:
                return
        result.chain = zlib.crc32(blob, result.chain)
        self._count(blob, now_s)

    def _count(self, blob: bytes, now_s: float) -> None:
        """`blob`'s events (whole ones, without comments) as received now."""
        result = self.result
        num = blob.count(EVENT_END)
        first = int(ID_LINE.search(blob).group(1))  # type: ignore[union-attr]
        last = int(ID_LINE.findall(blob)[-1]) if num > 1 else first
        if first != result.num_events + 1 or last != first + num - 1:
            result.is_contiguous = False
        result.num_events = max(result.num_events, last)
        result.arrivals_s.extend([now_s] * num)
        self._last_event_id = last
        if FINAL_EVENT in blob or ERROR_EVENT in blob:
            result.is_done = True
            self.close()


def expected_chain(events: list[bytes]) -> int:
    """The chain a client computes over a reply's log-derived events (each as SSE bytes)."""
    chain = 0
    for data in events:
        chain = zlib.crc32(data, chain)
    return chain


class Streams:
    """Every stream of one job: opened with at most `max_connecting` awaiting their answer."""

    def __init__(
        self,
        job: Job,
        num_held: Synchronized,  # type: ignore[type-arg]
        all_answered: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """`all_answered`, in capacity mode: awaited once every stream of this job has its answer,
        before they are closed (so the other client processes' streams are answered while these
        still hold their slots)."""
        self._job = job
        self._all_answered_hook = all_answered
        self._num_held = num_held
        self._connecting = asyncio.Semaphore(job.max_connecting)
        self.results = [StreamResult(reply_id) for reply_id in job.reply_ids]
        self._open: set[SseStream] = set()
        self._num_unanswered = len(self.results)
        self._all_answered = asyncio.Event()
        self._num_running = len(self.results)
        self._all_ended = asyncio.Event()
        self._is_closing = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.lags_ms = [0] * (MAX_DELAY_MS // DELAY_BIN_MS + 1)  # the process's event loop lag, sampled

    async def run(self) -> list[StreamResult]:
        loop = asyncio.get_running_loop()
        lag_watch = loop.create_task(self._watch_lag())
        try:
            return await self._run(loop)
        finally:
            lag_watch.cancel()

    async def _watch_lag(self, every_s: float = 0.02) -> None:
        """How late this process's loop wakes a timer (a histogram of 1 ms bins): the time a read
        that arrived waits here before it is timed."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + every_s
            await asyncio.sleep(every_s)
            late_ms = int(1000 * max(0.0, loop.time() - due))
            self.lags_ms[min(late_ms // DELAY_BIN_MS, len(self.lags_ms) - 1)] += 1

    async def _run(self, loop: asyncio.AbstractEventLoop) -> list[StreamResult]:
        for result in self.results:
            await self._connecting.acquire()
            self._spawn(self._open_stream(result, last_event_id=0))
        deadline = loop.time() + self._job.timeout_s  # from the last stream's request: opening may be slow
        if self._job.mode == "capacity":
            with contextlib.suppress(TimeoutError):  # the unanswered count as status 0
                await asyncio.wait_for(self._all_answered.wait(), max(1.0, deadline - loop.time()))
            if self._all_answered_hook is not None:
                await self._all_answered_hook()
            self._is_closing = True
            for stream in list(self._open):
                stream.close()
        try:
            await asyncio.wait_for(self._all_ended.wait(), max(1.0, deadline - loop.time()))
        except TimeoutError:
            self._is_closing = True
            for stream in list(self._open):
                stream.close()
        return self.results

    async def _open_stream(self, result: StreamResult, last_event_id: int) -> None:
        loop = asyncio.get_running_loop()
        answered = False

        def on_answer() -> None:
            nonlocal answered
            if not answered:
                answered = True
                self._connecting.release()
                if last_event_id == 0:
                    self._answered()
                if stream.status == 200:
                    with self._num_held.get_lock():
                        self._num_held.value += 1

        def on_end(ended: SseStream) -> None:
            self._open.discard(ended)
            if not answered:
                on_unanswered()
            elif ended.status == 200:
                with self._num_held.get_lock():
                    self._num_held.value -= 1
                if not self._is_closing and not result.is_done:
                    result.num_server_ends += 1
            if self._can_resume(ended, result):
                result.num_resumes += 1  # dropped before its end: resume after the last event it got
                self._spawn(self._resume(result))
                return
            self._ended()

        def on_unanswered() -> None:
            nonlocal answered
            answered = True
            self._connecting.release()
            if last_event_id == 0:
                self._answered()

        stream = SseStream(self._job, result, last_event_id, on_answer, on_end)
        try:
            await loop.create_connection(lambda: stream, self._job.host, self._job.port)
        except OSError:
            on_unanswered()
            self._ended()
            return
        self._open.add(stream)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _can_resume(self, ended: SseStream, result: StreamResult) -> bool:
        """A reading stream that ended before `done` (dropped by the server) resumes."""
        is_reading = self._job.mode == "read" and not self._is_closing
        return is_reading and ended.status == 200 and not result.is_done and result.num_resumes < MAX_RESUMES

    async def _resume(self, result: StreamResult) -> None:
        await self._connecting.acquire()
        await self._open_stream(result, last_event_id=result.num_events)

    def _answered(self) -> None:
        self._num_unanswered -= 1
        if self._num_unanswered == 0:
            self._all_answered.set()

    def _ended(self) -> None:
        self._num_running -= 1
        if self._num_running == 0:
            self._all_ended.set()


def live_delays_ms(results: list[StreamResult], written_s: dict[str, list[float]]) -> list[int]:
    """A histogram (1 ms bins) of write-to-delivery delays of the events each stream received
    live: written after the stream was attached. `written_s[reply][k - 1]`: when event id k's
    log entry appeared (0 for the meta event, which is not in the log)."""
    counts = [0] * (MAX_DELAY_MS // DELAY_BIN_MS + 1)
    for result in results:
        written = written_s.get(result.reply_id, [])
        for index, arrival_s in enumerate(result.arrivals_s[: len(written)]):
            written_at = written[index]
            if written_at > 0 and written_at >= result.attached_s:
                delay_ms = max(0, int(1000 * (arrival_s - written_at)))
                counts[min(delay_ms // DELAY_BIN_MS, len(counts) - 1)] += 1
    return counts


def summary(result: StreamResult) -> dict[str, Any]:
    return {
        "reply_id": result.reply_id, "status": result.status, "error_code": result.error_code,
        "has_retry_after": result.has_retry_after, "num_events": result.num_events, "is_done": result.is_done,
        "is_contiguous": result.is_contiguous, "chain": result.chain, "num_resumes": result.num_resumes,
        "num_server_ends": result.num_server_ends,
        "requested_s": result.requested_s, "attached_s": result.attached_s, "first_arrival_s": result.arrivals_s[0] if result.arrivals_s else 0.0,
        "last_arrival_s": result.arrivals_s[-1] if result.arrivals_s else 0.0,
    }  # fmt: skip


ANSWERED = "answered"  # a capacity job's word to the parent: every stream has its answer, none closed yet


def client_main(conn: Connection, num_held: Synchronized) -> None:  # type: ignore[type-arg]
    """A client process: jobs from the pipe until it closes."""
    # A session of its own, as the stack's services have: where the kernel groups a session's
    # processes for the scheduler (autogroup), the clients would otherwise share one group's time
    # on a CPU, as one process would, beside each service's group.
    with contextlib.suppress(OSError):
        os.setsid()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    while True:
        try:
            job: Job = conn.recv()
        except EOFError:
            return

        async def all_answered() -> None:
            conn.send(ANSWERED)
            await asyncio.to_thread(conn.recv)  # the parent's word that every client's streams are answered

        # uvloop: a read is one C call into the protocol, where asyncio's loop makes several in Python
        streams = Streams(job, num_held, all_answered if job.mode == "capacity" else None)
        results = uvloop.run(streams.run())
        conn.send([summary(result) for result in results])
        if job.mode == "read":
            written_s: dict[str, list[float]] = conn.recv()
            conn.send((live_delays_ms(results, written_s), streams.lags_ms))
