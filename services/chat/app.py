"""Wiring of the chat process: the product API (conversations, messages, SSE streams), the
OpenAI-compatible endpoints and the web page, over NATS (router), Redis (token log) and the
conversation store, which its lifespan owns."""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI
from sse_starlette.sse import AppStatus

from services.chat import (
    completions_api,
    conversations_api,
    errors,
    feedback_api,
    messages_api,
    openai_api,
    quotas,
    tokenize_api,
    usage_api,
    web,
)
from services.chat.attach_reads import AttachReads
from services.chat.auth import Authenticator
from services.chat.auth_throttle import FailedKeyThrottle, ThrottleConfig
from services.chat.body_limit import BodyLimit
from services.chat.config import ChatConfig
from services.chat.difficulty import open_judge
from services.chat.fanout import open_fanout
from services.chat.key_ring import KeyRing
from services.chat.latency import StampArrival
from services.chat.models_view import ModelsView
from services.chat.moderation import load_input_check
from services.chat.prompt import LoadedTokenizer
from services.chat.replies import ReplyStarter, forget_reply
from services.chat.rollout_view import RolloutView
from services.chat.shadow import Shadows
from services.chat.state import ChatState
from services.chat.status_api import LadderView, status_router
from services.chat.stream_slots import StreamSlots
from services.chat.summaries import Summaries, SummaryConfig, SummaryWriter
from services.chat.summary_reply import SummaryAsker
from tandem.bus import subjects
from tandem.config import Settings
from tandem.models.tokenizer import load_tokenizer
from tandem.quota import QuotaConfig, TokenBuckets
from tandem.runtime import Runtime, RuntimeConfig, create_app
from tandem.store import open_store, store_is_available

ROLE = "chat"
log = logging.getLogger(__name__)


def build_app(settings: Settings) -> FastAPI:
    keys = KeyRing.load(settings.api_keys, settings.api_keys_file)
    if keys.num_keys == 0 and settings.api_keys_file is None:
        log.warning("TANDEM_API_KEYS and TANDEM_API_KEYS_FILE are empty: every API request will be refused with 401")
    throttle = FailedKeyThrottle(ThrottleConfig(settings.auth_max_failures, settings.auth_failure_window_s))
    runtime = Runtime(RuntimeConfig.from_settings(ROLE, settings, uses_redis=True))
    assert runtime.redis is not None
    config = ChatConfig.from_settings(settings)
    redis, store, tokenizer = runtime.redis, open_store(settings), LoadedTokenizer()
    fanout = open_fanout(config, settings.redis_url, redis, runtime.config.instance_id)
    summary_config = SummaryConfig.from_settings(settings)
    asker = SummaryAsker(redis, runtime.bus, fanout, config.generate_timeout_s)
    writer = SummaryWriter(summary_config, config, redis, store, tokenizer, asker)
    state = ChatState(
        config=config,
        auth=Authenticator(keys, throttle),
        store=store,
        redis=redis,
        fanout=fanout,
        attach_reads=AttachReads.of(redis, fanout, config),
        stream_slots=StreamSlots(config.max_streams, config.stream_limits()),
        bus=runtime.bus,
        models=ModelsView(),
        tokenizer=tokenizer,
        quotas=TokenBuckets(redis, QuotaConfig.from_settings(settings)),
        difficulty=open_judge(settings.difficulty_classifier, settings.difficulty_timeout_s),  # for `auto`
        summaries=Summaries(summary_config, writer.write),
        # Loaded once in a process of its own, before the event loop runs (loading profanity-check's
        # model is slow); a bad TANDEM_INPUT_MODERATION is a StartupError, one line at start.
        input_check=load_input_check(settings.input_moderation, settings.moderation_threshold),
    )

    ladder = LadderView()  # the routers' overload ladder, for GET /v1/status
    rollouts = RolloutView()  # and their model rollouts
    state.shadows = Shadows(redis, ReplyStarter(redis, runtime.bus, state.door, None, config.generate_timeout_s).ask_router, forget_reply)

    async def subscribe(client) -> None:
        await client.subscribe(subjects.heartbeats_of("decode"), cb=state.models.on_heartbeat)
        await client.subscribe(subjects.LADDER, cb=ladder.on_status)
        await client.subscribe(subjects.ROLLOUT, cb=rollouts.on_status)

    async def on_start() -> None:
        state.tokenizer.load(await asyncio.to_thread(load_tokenizer, settings.model_path))
        await state.store.start()

    async def on_stop() -> None:
        if state.difficulty is not None:
            state.difficulty.close()
        if state.input_check is not None:
            state.input_check.close()
        if state.shadows is not None:
            await state.shadows.stop()
        if state.summaries is not None:  # its jobs first: they use the store and the feeds
            await state.summaries.close()
        await state.store.close()
        await state.fanout.close()

    async def tokenizer_loaded() -> bool:
        return state.tokenizer.is_loaded

    async def store_answers() -> bool:
        return await store_is_available(state.store)

    runtime.bus.on_connect(subscribe)
    # This instance drains its streams itself (FanoutHub.drain): sse-starlette's own drain would
    # also end, before it starts, the response of a message that arrives while the server
    # stops, which uvicorn then answers 500 though its reply runs.
    AppStatus.disable_automatic_graceful_drain()
    runtime.on_drain(state.fanout.drain)
    runtime.add_check("tokenizer", tokenizer_loaded)
    runtime.add_check("store", store_answers)
    app = create_app(
        runtime,
        routers=[
            conversations_api.router,
            messages_api.router,
            feedback_api.router,
            openai_api.router,
            completions_api.router,
            tokenize_api.router,
            usage_api.router,
            web.router,
            status_router(ladder, state.models, rollouts),
        ],
        on_start=on_start,
        on_stop=on_stop,
    )
    app.state.chat = state
    errors.install(app)
    quotas.install(app)
    app.add_middleware(StampArrival)  # a request's arrival, for the latency its client sees
    app.add_middleware(BodyLimit, max_body_bytes=settings.max_body_bytes)  # added last: the outermost
    return app
