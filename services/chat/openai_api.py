"""OpenAI-compatible `POST /v1/chat/completions` (stream and not), `GET /v1/models` and
`GET /v1/models/{model}`. They use
the same router and token log as the product API but are not stored as conversations. A completion
meets the product API's caps: a stream slot (streamed or not), each message's character limit and
the tier's prompt budget (services.chat.prompt_limits), the input check of every user message."""

from __future__ import annotations

import asyncio
from functools import partial

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse

from services.chat.deps import Answers, Arrived, Chat, CurrentUser, Router, StreamAdmission
from services.chat.errors import InvalidRequest, NotFound
from services.chat.latency import ReplyClock
from services.chat.models_view import ServedModel
from services.chat.moderation import last_user_text, refuse_openai_input, start_input_check, user_texts
from services.chat.openai_replies import served_model
from services.chat.openai_schemas import ChatCompletionBody
from services.chat.openai_shape import CHAT
from services.chat.prompt_limits import check_message_chars

router = APIRouter(prefix="/v1", tags=["openai"])


@router.get("/models")
async def list_models(state: Chat, user: CurrentUser) -> dict[str, object]:
    return {"object": "list", "data": [_model_object(m) for m in state.models.models().values()]}


@router.get("/models/{model}")
async def retrieve_model(state: Chat, user: CurrentUser, model: str) -> dict[str, object]:
    served = state.models.models().get(model)
    if served is None:
        raise NotFound(f"The model `{model}` does not exist or is not served.", code="model_not_found", param="model")
    return _model_object(served)


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    state: Chat,
    router: Router,
    answers: Answers,
    user: CurrentUser,
    slot: StreamAdmission,  # taken before the reply starts, streamed or not (503/429 past a limit)
    arrived: Arrived,
    body: ChatCompletionBody,
) -> JSONResponse | EventSourceResponse:
    body.refuse_unsupported()
    messages = [m.as_template_message() for m in body.messages]
    for message in messages:
        check_message_chars(message["content"], state.config.max_message_chars, "messages")
    state.door.check_all(user.tier, state.models.models)  # before any work for a message that cannot start
    tokenizer = state.tokenizer.get()
    tools = body.template_tools()
    tool_style = None
    if tools is not None:
        template = tokenizer.chat_template
        if template is None or not template.supports_tools:
            raise InvalidRequest(
                "the model's chat template has no tool support (it never reads `tools`): tools cannot be offered to this model",
                code="unsupported_parameter",
                param="tools",
            )
        tool_style = template.tool_call_style
        body.use_tool_style(tool_style)
    checking = start_input_check(state.input_check, *user_texts(messages))  # in its process, while routing and tokenizing
    choice = await served_model(router, tokenizer, user, body.model, last_user_text(messages))
    prompt_ids = await asyncio.to_thread(tokenizer.encode_chat, messages, True, tools)
    cleared = partial(refuse_openai_input, checking, user.tier.value, choice.model.name)  # awaited as the reply starts
    clock = ReplyClock(user.tier.value, choice.model.name, arrived)
    return await answers.answer(user, body, choice, prompt_ids, CHAT, "messages", clock, cleared, tool_style=tool_style)


def _model_object(model: ServedModel) -> dict[str, object]:
    return {
        "id": model.name,
        "object": "model",
        "created": model.created_unix_s,
        "owned_by": "tandem",
        "max_model_len": model.window_tokens,
    }
