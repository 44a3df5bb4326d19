"""OpenAI-compatible `POST /v1/chat/completions` (stream and not) and `GET /v1/models`. They use
the same router and token log as the product API but are not stored as conversations."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from services.chat.auth import CurrentUser
from services.chat.openai_replies import CHAT, answer, served_model
from services.chat.openai_schemas import ChatCompletionBody
from services.chat.state import State

router = APIRouter(prefix="/v1", tags=["openai"])


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
    model = await served_model(state, body.model)
    messages = [m.as_template_message() for m in body.messages]
    prompt_ids = await asyncio.to_thread(state.require_tokenizer().encode_chat, messages)
    return await answer(state, user, body, model, prompt_ids, CHAT, "messages")
