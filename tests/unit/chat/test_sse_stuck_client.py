"""A stream whose client stops reading ends, over real HTTP (uvicorn on a local port, in a thread
of its own): its events go straight to the server's send, untimed, so when the socket fills the
next keep-alive's timed send gives up and the response ends (its on_close runs), instead of
waiting forever."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import AsyncIterator, Iterator

import pytest
from helpers import served_in_thread

from services.chat.sse import StreamResponse
from tandem.runtime.app import TandemApp

CHUNK = b"data: " + b"x" * 65536 + b"\r\n\r\n"


class Served:
    def __init__(self) -> None:
        self.closed = threading.Event()
        self.num_chunks = 0
        self.responses: list[StreamResponse] = []


def build_app(served: Served) -> TandemApp:
    app = TandemApp()

    @app.get("/stream")
    async def stream() -> StreamResponse:
        async def endless() -> AsyncIterator[bytes]:
            while True:
                served.num_chunks += 1
                yield CHUNK
                await asyncio.sleep(0)

        response = StreamResponse(endless(), ping=1, send_timeout=2.0)
        response.on_close(served.closed.set)
        served.responses.append(response)
        return response

    return app


@pytest.fixture
def served() -> Iterator[tuple[int, Served]]:
    served = Served()
    with served_in_thread(build_app(served)) as port:
        yield port, served


def test_a_client_that_stops_reading_is_ended_by_a_keepalives_timed_send(served):
    port, state = served
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", port))
        client.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n\r\n")  # and never reads
        assert state.closed.wait(timeout=30), "the stream of a client that reads nothing never ended"
    [response] = state.responses
    assert response._server_send is not None, "the events took the direct path"
    assert state.num_chunks > 2, "the socket filled before the stream ended"
