"""The chat routes' FastAPI dependencies, as `Annotated` aliases: the caller, the lifespan's
parts (`Chat`), a stream slot, and the domain objects a route hands its work to, built from
those parts. Only route modules import this: domain code is handed the parts it uses."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request

from services.chat.auth import caller
from services.chat.latency import arrival_s
from services.chat.model_routing import ModelRouter, RoutingConfig
from services.chat.openai_replies import OpenAIAnswers
from services.chat.replies import ReplyStarter
from services.chat.state import ChatState
from services.chat.stream_slots import StreamSlot
from services.chat.streaming import ReplyStreams
from services.chat.turns import Turns
from tandem.config import ApiKey

# Every dependency here is async: FastAPI calls an async one on the event loop, a plain one in
# its thread pool (a thread hop per request, a GIL handoff that waits while the loop streams).


async def chat_state(request: Request) -> ChatState:
    return request.app.state.chat


Chat = Annotated[ChatState, Depends(chat_state)]


async def current_user(request: Request) -> ApiKey:
    """`Authorization: Bearer <key>` -> the caller, or Unauthenticated (401)."""
    return await caller(request)


CurrentUser = Annotated[ApiKey, Depends(current_user)]


async def arrival(request: Request) -> float:
    """When the request arrived (services.chat.latency.StampArrival), for its latencies."""
    return arrival_s(request)


Arrived = Annotated[float, Depends(arrival)]


async def admit_stream(state: Chat, user: CurrentUser) -> AsyncIterator[StreamSlot]:
    """A reply's slot (services.chat.stream_slots), taken before the route runs and given back
    once the response has been sent (a stream's last event, a whole answer's body), or when the
    route raises."""
    slot = state.stream_slots.admit(user)
    try:
        yield slot
    finally:
        slot.release()


StreamAdmission = Annotated[StreamSlot, Depends(admit_stream)]


async def model_router(state: Chat) -> ModelRouter:
    return ModelRouter(RoutingConfig.of(state.config), state.models, state.difficulty)


Router = Annotated[ModelRouter, Depends(model_router)]


async def reply_starter(state: Chat) -> ReplyStarter:
    return ReplyStarter(state.redis, state.bus, state.door, state.quotas, state.config.generate_timeout_s, state.shadows)


Starter = Annotated[ReplyStarter, Depends(reply_starter)]


async def reply_streams(state: Chat) -> ReplyStreams:
    return ReplyStreams.of(state.fanout, state.redis, state.store, state.config)


Streams = Annotated[ReplyStreams, Depends(reply_streams)]


async def chat_turns(state: Chat, router: Router, starter: Starter) -> Turns:
    return Turns(
        config=state.config,
        store=state.store,
        redis=state.redis,
        bus=state.bus,
        models=state.models,
        door=state.door,
        tokenizer=state.tokenizer,
        router=router,
        starter=starter,
        input_check=state.input_check,
        summaries=state.summaries,
    )


ChatTurns = Annotated[Turns, Depends(chat_turns)]


async def openai_answers(state: Chat, starter: Starter) -> OpenAIAnswers:
    config = state.config
    return OpenAIAnswers(
        starter,
        state.fanout,
        state.bus,
        state.tokenizer,
        answer_lengths=config.answer_lengths(),
        prompt_budget=config.prompt_budget,
        keepalive_s=config.keepalive_s,
    )


Answers = Annotated[OpenAIAnswers, Depends(openai_answers)]
