"""`tandem bench serve`'s client against a real HTTP server on a local port that answers in the
OpenAI streaming shape (and Tandem's chat SSE shape), each model name a different behaviour: the
timings and token counts it records, each failure counted by its kind (never raised), a request
that hangs ended by its timeout, and the concurrency limit held. (The e2e test runs it against
Tandem itself.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from helpers import wait_until

from tandem.devstack.proc import free_port
from tandem.ops.bench_client import OpenAIChat, TandemChat, send
from tandem.ops.bench_serve import RunConfig, first_model, run_load
from tandem.ops.workload import BenchRequest

REQUEST = BenchRequest(({"role": "user", "content": "hello"},), max_tokens=8)


def _chunk(text: str) -> bytes:
    return f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': text}, 'finish_reason': None}]})}\n\n".encode()


def build_peer(in_flight: list[int]) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": "peer-model", "object": "model"}, {"id": "other", "object": "model"}]}

    @app.post("/v1/chat/completions", response_model=None)
    async def completions(request: Request) -> StreamingResponse | JSONResponse:
        body = await request.json()
        model = body["model"]
        if model == "busy":
            return JSONResponse({"error": {"message": "slow down"}}, status_code=429, headers={"Retry-After": "7"})
        if model == "broken":
            return JSONResponse({"error": {"message": "oops"}}, status_code=500)

        async def stream() -> AsyncIterator[bytes]:
            in_flight[0] += 1
            in_flight[1] = max(in_flight[1], in_flight[0])
            try:
                yield b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}\n\n'
                if model == "slow":
                    await asyncio.Event().wait()  # until the client gives up
                for text in ("Hel", "lo", " there"):
                    await asyncio.sleep(0.02)
                    yield _chunk(text)
                if model == "fails":
                    yield b'data: {"error": {"message": "worker lost", "code": "worker_lost"}}\n\n'
                if model == "cut":
                    return
                if body.get("stream_options", {}).get("include_usage") and model != "no-usage":
                    yield b'data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}}\n\n'
                yield b"data: [DONE]\n\n"
            finally:
                in_flight[0] -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/conversations", status_code=201)  # as Tandem answers
    async def new_conversation() -> dict[str, str]:
        return {"id": "c-1"}

    @app.post("/v1/conversations/c-1/messages")
    async def message() -> StreamingResponse:
        async def stream() -> AsyncIterator[bytes]:
            yield b'id: 1\nevent: meta\ndata: {"message_id": "m-1", "model": "peer-model"}\n\n'
            for i, text in enumerate(("A", "B")):
                await asyncio.sleep(0.02)
                yield f'id: {i + 2}\nevent: delta\ndata: {{"text": "{text}"}}\n\n'.encode()
            yield b'id: 4\nevent: done\ndata: {"finish": "stop", "usage": {"input": 5, "cached": 0, "output": 2}}\n\n'

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest_asyncio.fixture
async def peer() -> AsyncIterator[tuple[httpx.AsyncClient, list[int]]]:
    in_flight = [0, 0]  # now, most at once
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_peer(in_flight), host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    await wait_until(lambda: _now(server.started), timeout_s=10)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}/v1/", timeout=10) as http:
        yield http, in_flight
    server.should_exit = True
    await task


async def _now(value: bool) -> bool:
    return value


async def test_a_streamed_reply_is_timed_and_counted_from_the_usage(peer):
    http, _ = peer
    result = await send(OpenAIChat("peer-model"), http, REQUEST, started_s=1.5, timeout_s=10)
    assert result.ok and result.error is None and result.started_s == 1.5
    assert len(result.delta_offsets_s) == 3 and result.ttft_s == result.delta_offsets_s[0] > 0
    assert all(itl >= 0.015 for itl in result.itls_s) and len(result.itls_s) == 2
    assert result.e2e_s >= result.delta_offsets_s[-1]
    assert (result.output_tokens, result.prompt_tokens, result.is_usage_counted) == (4, 9, True)


async def test_without_usage_the_content_deltas_are_counted(peer):
    http, _ = peer
    result = await send(OpenAIChat("no-usage"), http, REQUEST, started_s=0, timeout_s=10)
    assert result.ok and (result.output_tokens, result.is_usage_counted, result.prompt_tokens) == (3, False, None)


@pytest.mark.parametrize(
    ("model", "kind"), [("busy", "http_429"), ("broken", "http_500"), ("fails", "stream_worker_lost"), ("cut", "stream_incomplete")]
)
async def test_a_failure_is_counted_by_its_kind(peer, model, kind):
    http, _ = peer
    result = await send(OpenAIChat(model), http, REQUEST, started_s=0, timeout_s=10)
    assert not result.ok and result.error == kind
    assert result.retry_after_s == (7.0 if model == "busy" else None)


async def test_a_request_that_hangs_ends_at_its_timeout(peer):
    http, _ = peer
    result = await send(OpenAIChat("slow"), http, REQUEST, started_s=0, timeout_s=0.5)
    assert (result.ok, result.error) == (False, "timeout") and 0.5 <= result.e2e_s < 5


async def test_a_server_that_is_not_there_is_a_connect_error():
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{free_port()}/v1/", timeout=5) as http:
        result = await send(OpenAIChat("any"), http, REQUEST, started_s=0, timeout_s=5)
    assert (result.ok, result.error) == (False, "connect")


async def test_tandem_chat_api_replies_are_timed_from_their_sse_events(peer):
    http, _ = peer
    result = await send(TandemChat(), http, REQUEST, started_s=0, timeout_s=10)
    assert result.ok and len(result.delta_offsets_s) == 2
    assert (result.output_tokens, result.prompt_tokens, result.is_usage_counted) == (2, 5, True)


async def test_the_default_model_is_the_first_listed(peer):
    http, _ = peer
    assert await first_model(http) == "peer-model"


async def test_the_load_holds_the_concurrency_limit_and_returns_every_result(peer):
    http, in_flight = peer
    requests = [REQUEST] * 12
    config = RunConfig(request_rate=float("inf"), max_concurrency=3, seed=0, burstiness=1.0, request_timeout_s=10, show_progress=False)
    results, duration_s = await run_load(OpenAIChat("peer-model"), http, requests, config)
    assert len(results) == 12 and all(r.ok for r in results)
    assert in_flight[1] == 3  # all at once, but never more than three
    assert duration_s >= 4 * 0.06  # four waves of three, each at least three 20 ms gaps
