"""The services' HTTP protocol (tandem.runtime.http_limits) on a real uvicorn server and real
sockets: a client too slow with its headers or its body is cut off at the deadline, whatever it
keeps sending; complete requests and long SSE streams (the chat's, written straight to their
connection) are untouched; past the connection limit a request gets 503 with Retry-After."""

from __future__ import annotations

import asyncio
import itertools
import select
import socket
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from fastapi import Request
from fastapi.responses import StreamingResponse
from helpers import served_in_thread

from services.chat.direct_write import DirectWriter
from services.chat.sse import StreamResponse, WriterSlot
from tandem.runtime.app import TandemApp
from tandem.runtime.http_limits import HttpLimits, protocol_with

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.5
LIMITS = HttpLimits(max_connections=2, header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S)
MARGIN_S = 2.0  # the server's loop and the test share two busy cores
DRIP_S = 0.2  # a slow client's pace: a byte this often, each well inside any timeout
STREAM_S = 3.0  # longer than both timeouts together


def build_app() -> TandemApp:
    app = TandemApp()

    @app.get("/ok")
    async def ok() -> dict[str, bool]:
        return {"ok": True}

    @app.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"num_bytes": len(await request.body())}

    @app.get("/hold")
    async def hold() -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            for _ in range(100):  # ends after 10 s at most; sooner when the client leaves
                yield b"data: x\n\n"
                await asyncio.sleep(0.1)

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/stream")
    async def stream() -> StreamResponse:
        slot = WriterSlot()

        async def body() -> AsyncIterator[bytes]:
            yield b"id: 1\r\nevent: meta\r\ndata: {}\r\n\r\n"  # chunked from here: the writer can write
            await asyncio.sleep(0.05)
            ends_s = time.monotonic() + STREAM_S
            while time.monotonic() < ends_s:
                assert slot.writer is not None and slot.writer.write(DirectWriter.frame(b"data: x\r\n\r\n"))
                await asyncio.sleep(0.05)
            yield b"id: 2\r\nevent: done\r\ndata: {}\r\n\r\n"

        return StreamResponse(body(), ping=1, send_timeout=5.0, writer_slot=slot)

    return app


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with served_in_thread(build_app(), http=protocol_with(LIMITS)) as port:
        yield port


def seconds_until_closed(client: socket.socket, drip: bytes, give_up_s: float) -> float:
    """Sends `drip` a byte every DRIP_S (nothing, if empty) and returns the seconds until the
    server closed the connection; fails if it answered anything or was still open at `give_up_s`."""
    started = time.monotonic()
    for byte in itertools.cycle(drip or b"\0"):
        readable, _, _ = select.select([client], [], [], DRIP_S)
        try:
            if readable:
                data = client.recv(65536)
                assert not data, f"the server answered instead of closing: {data!r}"
                return time.monotonic() - started
            if drip:
                client.send(bytes([byte]))
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - started
        assert time.monotonic() - started < give_up_s, f"still open after {give_up_s} s"
    raise AssertionError("unreachable")


def read_response(client: socket.socket) -> bytes:
    """One response with a content-length body, read to its end."""
    received = bytearray()
    deadline = time.monotonic() + 10
    while b"\r\n\r\n" not in received or len(received) < received.index(b"\r\n\r\n") + 4 + content_length(received):
        assert time.monotonic() < deadline, f"no whole response within 10 s: {bytes(received)!r}"
        data = client.recv(65536)
        assert data, "the server closed the connection mid-response"
        received += data
    return bytes(received)


def content_length(head: bytearray) -> int:
    for line in bytes(head).split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


@pytest.mark.parametrize(
    ("start", "drip"),
    [
        (b"", b""),  # connects and says nothing
        (b"GET /ok HTTP/1.1\r\nHost: x\r\n", b"X-Slow: yes\r\n"),  # headers that never end
        (b"GET /ok?", b"a"),  # a request line that never ends
    ],
    ids=["silent", "endless_headers", "endless_request_line"],
)
def test_a_client_slow_with_its_headers_is_cut_off_at_the_header_timeout(port, start, drip):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(start)
        closed_after_s = seconds_until_closed(client, drip, give_up_s=HEADER_TIMEOUT_S + MARGIN_S)
    assert closed_after_s >= HEADER_TIMEOUT_S - DRIP_S, "closed by the timer, not at the first byte"


def test_the_header_timer_starts_again_for_the_next_request_on_a_kept_alive_connection(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(client).startswith(b"HTTP/1.1 200")
        client.sendall(b"GET /ok HTTP/1.1\r\n")
        closed_after_s = seconds_until_closed(client, b"X-Slow: yes\r\n", give_up_s=HEADER_TIMEOUT_S + MARGIN_S)
    assert closed_after_s >= HEADER_TIMEOUT_S - DRIP_S


def test_a_body_sent_too_slowly_is_cut_off_at_the_body_timeout_however_often_bytes_come(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 1000\r\n\r\nabc")
        closed_after_s = seconds_until_closed(client, b"x", give_up_s=BODY_TIMEOUT_S + MARGIN_S)
    assert closed_after_s >= BODY_TIMEOUT_S - DRIP_S


def test_complete_requests_with_and_without_a_body_are_answered(port):
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
        assert http.get("/ok").json() == {"ok": True}
        assert http.post("/echo", content=b"y" * 200_000).json() == {"num_bytes": 200_000}


def test_a_stream_longer_than_both_timeouts_runs_to_its_end_written_straight_to_its_connection(port):
    received = bytearray()
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=15) as client:
        client.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n")
        while not received.endswith(b"\r\n0\r\n\r\n"):
            data = client.recv(65536)
            assert data, "the server closed the stream before its end"
            received += data
    assert time.monotonic() - started >= HEADER_TIMEOUT_S + BODY_TIMEOUT_S
    assert b"event: done" in received
    assert received.count(b"data: x") >= 20, "the events went out by the DirectWriter, which knows this protocol"


def test_past_the_connection_limit_a_request_gets_503_with_retry_after_until_a_connection_closes(port):
    url = f"http://127.0.0.1:{port}"
    with (
        httpx.Client(base_url=url, timeout=10) as first,
        httpx.Client(base_url=url, timeout=10) as second,
        first.stream("GET", "/hold") as held,
        second.stream("GET", "/hold") as also_held,
    ):
        assert held.status_code == also_held.status_code == 200
        refused = httpx.get(f"{url}/ok", timeout=10)
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["connection"] == "close"
        assert refused.headers["x-request-id"] == refused.json()["error"]["request_id"]
        assert refused.json()["error"]["code"] == "server_busy"
    deadline = time.monotonic() + 10
    while (status := httpx.get(f"{url}/ok", timeout=10).status_code) != 200:
        assert time.monotonic() < deadline, f"still {status} 10 s after the held connections closed"
