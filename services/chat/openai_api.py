"""OpenAI-compatible `POST /v1/chat/completions` (stream and not) and `GET /v1/models`. They use
the same router and token log as the product API but are not stored as conversations."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sse_starlette.sse import EventSourceResponse

from services.chat.auth import CurrentUser
from services.chat.errors import InvalidRequest, NotFound, Unavailable
from services.chat.replies import ReplyRequest, begin_reply, cancel_reply, log_events, new_reply_id
from services.chat.sse import sse_response
from services.chat.state import ChatState, State
from services.chat.turns import MODEL_WAIT_S, SamplingChoice
from tandem.bus.events import is_final, openai_finish_reason
from tandem.tokenlog import ReplyGone
from tandem.v1.common_pb2 import FINISH_REASON_ERROR, Usage
from tandem.v1.tokens_pb2 import TokenEvent

router = APIRouter(prefix="/v1", tags=["openai"])
REPLY_LOST = "the reply's token log was lost before it ended; try again"


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class CompletionBody(BaseModel):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0)
    n: int = Field(default=1, ge=1, le=1)

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]


@router.get("/models")
async def list_models(state: State, user: CurrentUser) -> dict[str, object]:
    models = state.models.models()
    return {
        "object": "list",
        "data": [
            {"id": m.name, "object": "model", "created": 0, "owned_by": "tandem", "max_model_len": m.window_tokens} for m in models.values()
        ],
    }


@router.post("/chat/completions", response_model=None)
async def chat_completions(state: State, user: CurrentUser, body: CompletionBody) -> JSONResponse | EventSourceResponse:
    model = await state.models.resolve_soon(body.model, MODEL_WAIT_S)
    if model is None:
        raise NotFound(f"The model `{body.model}` does not exist or is not served.", code="model_not_found", param="model")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    prompt_ids = await asyncio.to_thread(state.require_tokenizer().encode_chat, messages)
    room = model.window_tokens - len(prompt_ids)
    if room < 1:
        raise InvalidRequest(
            f"This model's maximum context length is {model.window_tokens} tokens; the messages have {len(prompt_ids)}.",
            code="context_length_exceeded",
            param="messages",
        )
    wanted = body.max_completion_tokens or body.max_tokens or state.config.max_answer_tokens
    sampling = SamplingChoice(temperature=body.temperature, top_p=body.top_p, seed=body.seed).params(min(wanted, room))
    sampling.stop.extend(body.stop_strings())
    reply_id = f"chatcmpl-{new_reply_id()}"
    await begin_reply(state, ReplyRequest(reply_id, user, model.name, prompt_ids, 0, sampling))
    created = int(time.time())
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return sse_response(state, completion_chunks(state, reply_id, model.name, created, include_usage))
    return await _completion(state, reply_id, model.name, created)


async def _completion(state: ChatState, reply_id: str, model: str, created: int) -> JSONResponse:
    parts: list[str] = []
    last = TokenEvent()
    async with _cancel_unless_finished(state, reply_id) as finished:
        try:
            async for event in log_events(state, reply_id):
                parts.append(event.text)
                last = event
        except ReplyGone:
            raise Unavailable(REPLY_LOST, code="reply_expired") from None
        finished.append(True)
    if last.finish == FINISH_REASON_ERROR:
        raise Unavailable(last.error.message or "the reply failed", code=last.error.code or "error", retry_after_s=last.error.retry_after_s)
    usage = last.usage
    return JSONResponse(
        {
            "id": reply_id,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(parts)},
                    "finish_reason": openai_finish_reason(last.finish),
                }
            ],
            "usage": {**_usage(usage), "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}},
        }
    )


async def completion_chunks(
    state: ChatState, reply_id: str, model: str, created: int, include_usage: bool
) -> AsyncIterator[dict[str, str]]:
    """A streamed completion's SSE data, read from the reply's log: chunks, then `[DONE]`. A reply
    that fails, or whose log vanishes before its end, gives an `error` chunk instead of the rest."""

    def data(body: dict[str, object]) -> dict[str, str]:
        return {"data": json.dumps(body, ensure_ascii=False)}

    def chunk(choices: list[dict[str, object]], **extra: object) -> dict[str, str]:
        return data({"id": reply_id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices, **extra})

    def delta(content: dict[str, str], finish: str | None) -> dict[str, str]:
        return chunk([{"index": 0, "delta": content, "finish_reason": finish}])

    def error(message: str, code: str) -> dict[str, str]:
        return data({"error": {"message": message, "type": "server_error", "code": code}})

    yield delta({"role": "assistant", "content": ""}, None)
    async with _cancel_unless_finished(state, reply_id) as finished:
        try:
            async for event in log_events(state, reply_id):
                if event.finish == FINISH_REASON_ERROR:
                    yield error(event.error.message, event.error.code)
                    break
                if event.text:
                    yield delta({"content": event.text}, None)
                if is_final(event):
                    yield delta({}, openai_finish_reason(event.finish))
                    if include_usage:
                        yield chunk([], usage=_usage(event.usage))
        except ReplyGone:
            yield error(REPLY_LOST, "reply_expired")
        else:
            finished.append(True)
    yield {"data": "[DONE]"}


def _usage(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.input_tokens + usage.output_tokens,
    }


@contextlib.asynccontextmanager
async def _cancel_unless_finished(state: ChatState, reply_id: str) -> AsyncIterator[list[bool]]:
    """An OpenAI client that goes away cannot resume: its reply is cancelled at once."""
    finished: list[bool] = []
    try:
        yield finished
    finally:
        if not finished:
            with contextlib.suppress(Exception):
                await cancel_reply(state, reply_id, "client_gone")
