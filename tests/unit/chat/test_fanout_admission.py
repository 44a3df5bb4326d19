"""Stream slots over real HTTP (uvicorn on a local port): a stream past the user's tier limit is a
429 `too_many_streams`, one past the instance's capacity a 503 `streams_full`, both with
Retry-After and before any stream starts; a slot is held while its stream is open and freed when
the client goes away."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from types import SimpleNamespace

import httpx
import pytest_asyncio
import uvicorn
from fastapi import FastAPI
from helpers import wait_until

from services.chat import errors
from services.chat.auth import Authenticator
from services.chat.config import ChatConfig
from services.chat.deps import Chat, StreamAdmission
from services.chat.key_ring import KeyRing
from services.chat.sse import StreamResponse, sse_response
from services.chat.stream_slots import StreamSlots
from tandem.config import ApiKey, Tier

CONFIG = ChatConfig("", 16, 512, 512, 1000, 60, max_streams=3, stream_limit_free=2)
KEYS = {"free-key": ApiKey("u-free", Tier.FREE), "pro-key": ApiKey("u-pro", Tier.PRO)}


def build_app(slots: StreamSlots) -> FastAPI:
    app = FastAPI()
    app.state.chat = SimpleNamespace(config=CONFIG, auth=Authenticator(KeyRing.load(KEYS, None)), stream_slots=slots)
    errors.install(app)

    @app.get("/stream")
    async def stream(state: Chat, slot: StreamAdmission) -> StreamResponse:
        async def endless() -> AsyncIterator[bytes]:
            yield b"event: open\r\ndata: {}\r\n\r\n"
            await asyncio.Event().wait()  # until the client goes away
            yield b""

        return sse_response(endless(), state.config.keepalive_s)

    return app


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest_asyncio.fixture
async def served() -> AsyncIterator[tuple[str, StreamSlots]]:
    slots = StreamSlots(CONFIG.max_streams, CONFIG.stream_limits())
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(slots), host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    await wait_until(lambda: _now(server.started), timeout_s=10)
    yield f"http://127.0.0.1:{port}", slots
    server.should_exit = True
    await task


class Stream:
    """A client's request; when it is a 200, its stream is open (its reader is kept: a reader
    that is dropped closes the stream)."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.status_code = response.status_code
        self.headers = response.headers
        self._reader = response.aiter_bytes()

    async def opened(self) -> Stream:
        if self.status_code == 200:
            await anext(self._reader)
        else:
            await self.response.aread()
        return self

    def json(self) -> dict:
        return self.response.json()

    async def aclose(self) -> None:
        await self.response.aclose()


async def open_stream(client: httpx.AsyncClient, key: str) -> Stream:
    request = client.build_request("GET", "/stream", headers={"Authorization": f"Bearer {key}"})
    return await Stream(await client.send(request, stream=True)).opened()


async def test_past_the_tier_limit_is_429_and_past_capacity_is_503_and_a_closed_stream_frees_its_slot(served):
    url, slots = served
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        first, second = await open_stream(client, "free-key"), await open_stream(client, "free-key")
        assert (first.status_code, second.status_code, slots.num_open) == (200, 200, 2)
        refused = await open_stream(client, "free-key")
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["code"] == "too_many_streams"
        third = await open_stream(client, "pro-key")
        full = await open_stream(client, "pro-key")
        assert third.status_code == 200 and full.status_code == 503 and int(full.headers["Retry-After"]) >= 1
        assert full.json()["error"]["code"] == "streams_full"
        assert slots.num_open == 3, "refusals hold nothing"
        await first.aclose()  # the client goes away
        await wait_until(lambda: _now(slots.num_open == 2))
        again = await open_stream(client, "free-key")
        assert again.status_code == 200
        for response in (second, third, again):
            await response.aclose()
    await wait_until(lambda: _now(slots.num_open == 0))


async def _now(value: bool) -> bool:
    return value
