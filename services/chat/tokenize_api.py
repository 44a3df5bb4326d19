"""vLLM's server extras beside the OpenAI API, in vLLM's shapes: `POST /tokenize` (a prompt, or
chat messages through the chat template), `POST /detokenize` and `GET /health`
(200 once a completion can start: the tokenizer is loaded and a model is served, else 503; it reads
only this process's memory, no Redis or store, so it stays cheap for anyone to ask). `GET /version`
is on the ops port (tandem.runtime.app.ops_app).

`/tokenize` and `/detokenize` are metered as completions are: each call draws on the caller's token
quota (services.chat.quotas.charge_tokens) what its tokens would cost as a prompt, at least one
unit; past the quota it is a 429 with Retry-After. A detokenize is charged before it decodes (its
count is in the request); a tokenize once it has counted, before it answers."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from services.chat.deps import Chat, CurrentUser
from services.chat.errors import InvalidRequest, NotFound, Unavailable
from services.chat.limits import MAX_MESSAGES, ModelName
from services.chat.models_view import ModelsView
from services.chat.openai_schemas import ChatMessage
from services.chat.quotas import charge_tokens

router = APIRouter(tags=["openai"])
MAX_DETOKENIZE_TOKENS = 1 << 20


class TokenizeBody(BaseModel):
    """A `prompt`, or `messages` rendered by the chat template (as a chat completion would be)."""

    model_config = ConfigDict(extra="forbid")
    model: ModelName | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None  # default: True for a prompt (BOS); chat templates write their own
    add_generation_prompt: bool = True


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: ModelName | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_TOKENS)


@router.post("/tokenize")
async def tokenize(state: Chat, user: CurrentUser, body: TokenizeBody) -> dict[str, object]:
    window_tokens = _window_of(state.models, body.model)
    tokenizer = state.tokenizer.get()
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequest("send either `prompt` or `messages`", param="prompt")
    if body.messages is not None:
        messages = [m.as_template_message() for m in body.messages]
        ids = await asyncio.to_thread(tokenizer.encode_chat, messages, body.add_generation_prompt)
    else:
        add_bos = body.add_special_tokens is not False
        ids = await asyncio.to_thread(tokenizer.encode, body.prompt or "", add_bos)
    await charge_tokens(state.quotas, user, len(ids), "messages" if body.messages is not None else "prompt")
    return {"count": len(ids), "max_model_len": window_tokens, "tokens": ids, "token_strs": None}


@router.post("/detokenize")
async def detokenize(state: Chat, user: CurrentUser, body: DetokenizeBody) -> dict[str, str]:
    _window_of(state.models, body.model)
    tokenizer = state.tokenizer.get()
    outside = next((t for t in body.tokens if not 0 <= t < tokenizer.vocab_size), None)
    if outside is not None:
        raise InvalidRequest(f"token id {outside} is outside the vocabulary (0 to {tokenizer.vocab_size - 1})", param="tokens")
    await charge_tokens(state.quotas, user, len(body.tokens), "tokens")
    return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens)}


@router.get("/health")
async def health(state: Chat) -> dict[str, str]:
    state.tokenizer.get()
    if state.models.resolve("auto") is None:
        raise Unavailable("no model is being served yet; try again shortly", code="no_workers", retry_after_s=2.0)
    return {"status": "ok"}


def _window_of(models: ModelsView, model: str | None) -> int | None:
    """The named model's context window (any served model's when none is named); 404 for a model
    that is not served."""
    served = models.resolve(model or "auto")
    if served is None and model not in (None, "", "auto"):
        raise NotFound(f"The model `{model}` does not exist or is not served.", code="model_not_found", param="model")
    return served.window_tokens if served is not None else None
