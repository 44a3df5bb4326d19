"""The body limit: a declared or streamed body over the limit is answered 413 in the OpenAI error
shape before the app reads it whole (or at all), whatever the route would have said first."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
from fastapi import Depends, FastAPI, Request
from starlette.types import Message, Receive, Scope, Send

from services.chat.body_limit import BodyLimit
from services.chat.errors import Unauthenticated

LIMIT = 1024


class BodyReads:
    """What the app under test saw: how many bytes it read, and whether a handler ran."""

    def __init__(self) -> None:
        self.num_bytes = 0
        self.num_handled = 0


def small_app(reads: BodyReads) -> FastAPI:
    def require_key(request: Request) -> None:
        if request.headers.get("authorization") != "Bearer k":
            raise Unauthenticated("no key")

    app = FastAPI()

    @app.post("/echo", dependencies=[Depends(require_key)])
    async def echo(request: Request) -> dict[str, int]:
        reads.num_handled += 1
        async for chunk in request.stream():
            reads.num_bytes += len(chunk)
        return {"num_bytes": reads.num_bytes}

    @app.post("/json")
    async def parse(body: dict[str, str]) -> dict[str, int]:
        reads.num_handled += 1
        return {"num_keys": len(body)}

    app.add_middleware(BodyLimit, max_body_bytes=LIMIT)
    return app


def client_of(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


async def chunks(num_chunks: int, size: int) -> AsyncIterator[bytes]:
    for _ in range(num_chunks):
        yield b"x" * size


def assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert (error["code"], error["type"]) == ("body_too_large", "invalid_request_error")
    assert str(LIMIT) in error["message"]


async def test_a_declared_oversized_body_is_refused_before_authentication_and_never_read():
    reads = BodyReads()
    async with client_of(small_app(reads)) as client:
        response = await client.post("/echo", content=b"x" * (LIMIT + 1))  # no key: 413 still comes first
    assert_refused(response)
    assert (reads.num_handled, reads.num_bytes) == (0, 0)


async def test_a_body_at_the_limit_passes_whole():
    reads = BodyReads()
    async with client_of(small_app(reads)) as client:
        response = await client.post("/echo", content=b"x" * LIMIT, headers={"Authorization": "Bearer k"})
    assert response.status_code == 200 and response.json() == {"num_bytes": LIMIT}


async def test_a_chunked_body_is_refused_once_the_bytes_received_pass_the_limit():
    reads = BodyReads()
    async with client_of(small_app(reads)) as client:
        response = await client.post("/echo", content=chunks(100, 256), headers={"Authorization": "Bearer k"})
    assert_refused(response)
    # The handler stopped at the chunk that passed the limit: nowhere near the 25,600 bytes sent.
    assert reads.num_bytes <= LIMIT


async def test_a_chunked_json_body_is_refused_before_it_is_parsed():
    reads = BodyReads()
    async with client_of(small_app(reads)) as client:
        response = await client.post("/json", content=chunks(10, 200), headers={"Content-Type": "application/json"})
    assert_refused(response)
    assert reads.num_handled == 0


async def test_a_chunked_body_under_the_limit_passes():
    reads = BodyReads()
    async with client_of(small_app(reads)) as client:
        response = await client.post("/echo", content=chunks(4, 200), headers={"Authorization": "Bearer k"})
    assert response.status_code == 200 and response.json() == {"num_bytes": 800}


async def test_the_declared_refusal_asks_to_close_the_connection_and_reads_nothing():
    received: list[Message] = []

    async def never_called(scope: Scope, receive: Receive, send: Send) -> None:
        raise AssertionError("the app must not run")

    async def receive() -> Message:
        received.append({"type": "http.request"})
        raise AssertionError("the body must not be read")

    sent: list[Message] = []

    async def send(message: Message) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [(b"content-length", str(2 * LIMIT).encode())]}
    await BodyLimit(never_called, LIMIT)(scope, receive, send)
    assert received == []
    assert sent[0]["status"] == 413 and (b"connection", b"close") in sent[0]["headers"]
