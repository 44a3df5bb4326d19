"""One streamed request of `tandem bench serve`, timed as a client sees it: time to first token
(the first content delta), the gaps between content deltas, and the whole request. Two
endpoints: OpenAI's chat completions (any compatible server) and Tandem's own chat API. A failed
request is a result with an error kind, never an exception: a load test counts errors, it does not
stop at the first."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import httpx

from tandem.ops.workload import BenchRequest


@dataclass
class RequestResult:
    """`started_s`: when it was sent, from the run's start; `delta_offsets_s`: each content delta's
    arrival, from the request's start. `output_tokens` comes from the server's usage when it gave
    one (`is_usage_counted`), else it is the number of content deltas."""

    started_s: float
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float = 0.0
    delta_offsets_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    is_usage_counted: bool = False
    retry_after_s: float | None = None

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.delta_offsets_s, self.delta_offsets_s[1:], strict=False)]


class StreamFailed(Exception):
    """The server said, inside a 200 stream, that the reply failed; `kind` is its error code."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


class HttpRefused(Exception):
    def __init__(self, status: int, retry_after_s: float | None) -> None:
        super().__init__(status)
        self.status = status
        self.retry_after_s = retry_after_s


class Endpoint(Protocol):
    async def prepare(self, http: httpx.AsyncClient, request: BenchRequest) -> tuple[str, dict[str, object]]:
        """The path and JSON body to stream from, after any untimed setup."""

    async def read(self, response: httpx.Response, result: RequestResult, started: float) -> None:
        """Fills `result` as the stream arrives (deltas, usage); raises StreamFailed on a failure."""


def _retry_after_s(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


async def _check_status(response: httpx.Response) -> None:
    if not response.is_success:
        await response.aread()
        raise HttpRefused(response.status_code, _retry_after_s(response))


@dataclass(frozen=True)
class OpenAIChat:
    """POST {base}/chat/completions with stream=true and usage asked for in the last chunk."""

    model: str
    temperature: float = 0.0
    ignore_eos: bool = False  # vLLM's extension: every reply runs to max_tokens

    async def prepare(self, http: httpx.AsyncClient, request: BenchRequest) -> tuple[str, dict[str, object]]:
        body: dict[str, object] = {
            "model": self.model,
            "messages": list(request.messages),
            "max_tokens": request.max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        return "chat/completions", body

    async def read(self, response: httpx.Response, result: RequestResult, started: float) -> None:
        async for _, data in _sse_events(response):
            if data == "[DONE]":
                return
            chunk = json.loads(data)
            if "error" in chunk:
                raise StreamFailed(str(chunk["error"].get("code") or "error"))
            for choice in chunk.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    result.delta_offsets_s.append(time.perf_counter() - started)
            if usage := chunk.get("usage"):
                result.output_tokens, result.is_usage_counted = int(usage["completion_tokens"]), True
                result.prompt_tokens = int(usage["prompt_tokens"])
        raise StreamFailed("incomplete")  # the body ended without [DONE]


@dataclass(frozen=True)
class TandemChat:
    """Tandem's chat API: a new conversation per request (made before the clock starts), then POST
    its messages with the last user message; SSE events meta, delta {"text"}, done {"usage"}, error, moderated."""

    model: str = "auto"
    temperature: float = 0.0

    async def prepare(self, http: httpx.AsyncClient, request: BenchRequest) -> tuple[str, dict[str, object]]:
        created = await http.post("conversations")
        await _check_status(created)
        body = {"content": request.last_user_text, "model": self.model, "max_tokens": request.max_tokens, "temperature": self.temperature}
        return f"conversations/{created.json()['id']}/messages", body

    async def read(self, response: httpx.Response, result: RequestResult, started: float) -> None:
        async for event, data in _sse_events(response):
            payload = json.loads(data)
            if event == "delta" and payload.get("text"):
                result.delta_offsets_s.append(time.perf_counter() - started)
            elif event == "error":
                raise StreamFailed(str(payload.get("code") or "error"))
            elif event == "moderated":  # the output check withdrew the answer
                raise StreamFailed("moderated")
            elif event == "done":
                usage = payload.get("usage") or {}
                if "output" in usage:
                    result.output_tokens, result.is_usage_counted = int(usage["output"]), True
                    result.prompt_tokens = int(usage["input"])
                return
        raise StreamFailed("incomplete")


async def _sse_events(response: httpx.Response) -> AsyncIterator[tuple[str, str]]:
    """(event, data) per SSE event; comments and keep-alives skipped."""
    event, data_lines = "message", list[str]()
    async for line in response.aiter_lines():
        if line == "":
            if data_lines:
                yield event, "\n".join(data_lines)
            event, data_lines = "message", list[str]()
        elif line.startswith("data:"):
            data_lines.append(line[5:].removeprefix(" "))
        elif line.startswith("event:"):
            event = line[6:].strip()
    if data_lines:
        yield event, "\n".join(data_lines)


async def send(endpoint: Endpoint, http: httpx.AsyncClient, request: BenchRequest, started_s: float, timeout_s: float) -> RequestResult:
    """One request, timed, within `timeout_s` overall; its failure is recorded by kind."""
    result = RequestResult(started_s=started_s)
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            path, body = await endpoint.prepare(http, request)
            started = time.perf_counter()
            async with http.stream("POST", path, json=body) as response:
                await _check_status(response)
                await endpoint.read(response, result, started)
        result.ok = bool(result.delta_offsets_s)
        result.error = None if result.ok else "no_output"
    except HttpRefused as exc:
        result.error, result.retry_after_s = f"http_{exc.status}", exc.retry_after_s
    except StreamFailed as exc:
        result.error = f"stream_{exc.kind}"
    except (TimeoutError, httpx.TimeoutException):
        result.error = "timeout"
    except httpx.ConnectError:
        result.error = "connect"
    except httpx.RemoteProtocolError:
        result.error = "protocol"
    except httpx.TransportError:
        result.error = "transport"
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        result.error = "bad_response"
    result.e2e_s = time.perf_counter() - started
    if result.delta_offsets_s:
        result.ttft_s = result.delta_offsets_s[0]
    if not result.is_usage_counted:
        result.output_tokens = len(result.delta_offsets_s)
    return result
