"""Keep-alives over real HTTP (uvicorn on a local port, in a thread of its own): a stream whose
events are written straight to its connection (a DirectWriter) gets no keep-alive while they
flow, and one that is idle gets them at its interval."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from helpers import served_in_thread

from services.chat.direct_write import DirectWriter
from services.chat.sse import StreamResponse, WriterSlot
from tandem.runtime.app import TandemApp

STREAM_S = 2.5  # each stream's length; keep-alives are due every second


def build_app() -> TandemApp:
    app = TandemApp()

    @app.get("/stream/{kind}")
    async def stream(kind: str) -> StreamResponse:
        slot = WriterSlot()

        async def body() -> AsyncIterator[bytes]:
            yield b"id: 1\r\nevent: meta\r\ndata: {}\r\n\r\n"  # the start: the response is chunked from here
            await asyncio.sleep(0.05)
            ends_s = time.monotonic() + STREAM_S
            while time.monotonic() < ends_s:
                if kind == "flowing":
                    assert slot.writer is not None and slot.writer.write(DirectWriter.frame(b"data: x\r\n\r\n"))
                await asyncio.sleep(0.05)
            yield b"id: 2\r\nevent: done\r\ndata: {}\r\n\r\n"

        return StreamResponse(body(), ping=1, send_timeout=5.0, writer_slot=slot)

    return app


@pytest.fixture
def port() -> Iterator[int]:
    with served_in_thread(build_app(), http="httptools") as port:
        yield port


def read_stream(port: int, kind: str) -> bytes:
    """The whole response, to the end of its chunked body."""
    received = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=15) as client:
        client.sendall(f"GET /stream/{kind} HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n".encode())
        while not received.endswith(b"\r\n0\r\n\r\n"):
            data = client.recv(65536)
            assert data, "the server closed the connection before the response ended"
            received += data
    return bytes(received)


def test_a_stream_written_straight_to_its_connection_gets_no_keepalive_while_events_flow(port):
    received = read_stream(port, "flowing")
    assert received.count(b"data: x") >= 10, "the events went out by the direct writer"
    assert b": ping" not in received


def test_an_idle_stream_gets_its_keepalives(port):
    received = read_stream(port, "idle")
    assert received.count(b": ping") >= 2
