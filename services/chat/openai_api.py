"""OpenAI-compatible `POST /v1/chat/completions` (stream and not) and `GET /v1/models`. They use
the same router and token log as the product API but are not stored as conversations."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from services.chat.auth import CurrentUser
from services.chat.errors import InvalidRequest, NotFound, Unavailable
from services.chat.openai_schemas import ChatCompletionBody, openai_finish_reason
from services.chat.replies import ReplyRequest, begin_reply, cancel_reply, log_events, new_reply_id
from services.chat.sse import sse_response
from services.chat.state import ChatState, State
from services.chat.turns import MODEL_WAIT_S
from tandem import __version__
from tandem.bus.events import is_final
from tandem.tokenlog import ReplyGone
from tandem.v1.common_pb2 import FINISH_REASON_ERROR, Usage
from tandem.v1.tokens_pb2 import TokenEvent

router = APIRouter(prefix="/v1", tags=["openai"])
REPLY_LOST = "the reply's token log was lost before it ended; try again"
# What OpenAI's `system_fingerprint` stands for: the serving software that produced the answer.
SYSTEM_FINGERPRINT = f"tandem-{__version__}"


@router.get("/models")
async def list_models(state: State, user: CurrentUser) -> dict[str, object]:
    models = state.models.models()
    return {
        "object": "list",
        "data": [
            {"id": m.name, "object": "model", "created": m.created_unix_s, "owned_by": "tandem", "max_model_len": m.window_tokens}
            for m in models.values()
        ],
    }


@router.post("/chat/completions", response_model=None)
async def chat_completions(state: State, user: CurrentUser, body: ChatCompletionBody) -> JSONResponse | EventSourceResponse:
    body.refuse_unsupported()
    model = await state.models.resolve_soon(body.model, MODEL_WAIT_S)
    if model is None:
        raise NotFound(f"The model `{body.model}` does not exist or is not served.", code="model_not_found", param="model")
    messages = [m.as_template_message() for m in body.messages]
    prompt_ids = await asyncio.to_thread(state.require_tokenizer().encode_chat, messages)
    room = model.window_tokens - len(prompt_ids)
    if room < 1:
        raise InvalidRequest(
            f"This model's maximum context length is {model.window_tokens} tokens; the messages have {len(prompt_ids)}.",
            code="context_length_exceeded",
            param="messages",
        )
    sampling = body.sampling(state.config.max_answer_tokens, room)
    reply_id = f"chatcmpl-{new_reply_id()}"
    await begin_reply(state, ReplyRequest(reply_id, user, model.name, prompt_ids, 0, sampling))
    created = int(time.time())
    if body.stream:
        return sse_response(state, completion_chunks(state, reply_id, model.name, created, body.wants_usage_chunk))
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
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(parts)},
                    "finish_reason": openai_finish_reason(last.finish),
                }
            ],
            "usage": _usage(usage),
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
        return data(
            {
                "id": reply_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "system_fingerprint": SYSTEM_FINGERPRINT,
                "choices": choices,
                **extra,
            }
        )

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


def _usage(usage: Usage) -> dict[str, object]:
    return {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.input_tokens + usage.output_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
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
