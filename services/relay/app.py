"""Wiring of the relay process: every TokenEvent in the token stream (one durable JetStream
consumer that all relays share) is appended to its reply's Redis token log and then
acknowledged; a reply's final event gets its assistant turn stored; a sweep several times a
second continues replies whose worker was lost and, about once a second, cancels replies nobody
reads and retries turns the store did not take."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import FastAPI
from nats.aio.client import Client
from redis.exceptions import RedisError

from services.relay import metrics
from services.relay.consumer import TokenConsumer, TokenConsumerConfig
from services.relay.persist import PersistConfig, persist_reply
from services.relay.stalls import Claims, StallConfig, StallWatcher
from services.relay.sweep import SweepConfig, Sweeper
from tandem.bus.token_stream import publish_token
from tandem.config import Settings
from tandem.runtime import Runtime, RuntimeConfig, create_app
from tandem.store import StoreUnavailable, open_store, store_is_available
from tandem.tokenlog import TokenLogWriter
from tandem.v1.tokens_pb2 import TokenEvent

ROLE = "relay"
log = logging.getLogger(__name__)


def build_app(settings: Settings) -> FastAPI:
    runtime = Runtime(RuntimeConfig.from_settings(ROLE, settings, uses_redis=True))
    assert runtime.redis is not None
    redis = runtime.redis
    store = open_store(settings)
    writer = TokenLogWriter(redis, settings.token_log_ttl_s, running_ttl_s=settings.running_reply_ttl_s)
    persist_config = PersistConfig(ttl_s=settings.token_log_ttl_s, keep_s=settings.running_reply_ttl_s)
    sweep_config = SweepConfig(reader_idle_timeout_s=settings.reader_idle_timeout_s)
    stall_config = StallConfig(
        stall_timeout_s=settings.stall_timeout_s,
        dispatch_grace_s=settings.dispatch_grace_s,
        max_continuations=settings.max_continuations,
        running_ttl_s=settings.running_reply_ttl_s,
    )
    claims = Claims()
    tasks: set[asyncio.Task[None]] = set()
    consumer: TokenConsumer | None = None
    stalls: StallWatcher | None = None

    async def persist(reply_id: str) -> bool:
        stored = await persist_reply(redis, store, reply_id, persist_config)
        if not stored:
            metrics.REPLIES_UNPERSISTED.inc()
        return stored

    async def log_event(event: TokenEvent) -> None:
        """Raises when the log cannot take it, so the event is redelivered."""
        appended = await writer.append(event)
        if appended.is_stale:
            metrics.EVENTS_DROPPED.labels(why="stale").inc()
        elif appended.num_appended == 0:
            metrics.EVENTS_DROPPED.labels(why="duplicate_or_held").inc()
        metrics.EVENTS_LOGGED.inc(appended.num_appended)
        if appended.final_status is None:
            return
        metrics.REPLIES_FINISHED.labels(status=appended.final_status.value).inc()
        try:  # the append listed it as unpersisted: a sweep retries whatever fails here
            await persist(event.reply_id)
        except (StoreUnavailable, RedisError, OSError) as exc:
            log.warning("reply %s: not stored yet (%s); a sweep retries", event.reply_id, exc)

    async def publish(subject: str, data: bytes) -> None:
        await runtime.bus.client.publish(subject, data)

    async def publish_final(event: TokenEvent) -> None:
        await publish_token(runtime.bus.client.jetstream(), event)

    async def sweep_forever(sweeper: Sweeper) -> None:
        while True:
            try:
                await sweeper.sweep()
            except StoreUnavailable as exc:
                log.warning("sweep: store unavailable: %s", exc)
            except (RedisError, OSError) as exc:
                log.warning("sweep: redis unavailable: %s", exc)
            except Exception:  # a sweep must never stop for good
                log.exception("sweep failed")
            await asyncio.sleep(sweep_config.interval_s)

    async def start_watching(client: Client) -> None:
        nonlocal consumer, stalls
        consumer = TokenConsumer(client, log_event, TokenConsumerConfig(max_age_s=settings.token_stream_max_age_s))
        stalls = StallWatcher(redis, client, claims, publish_final, stall_config)
        await claims.listen(client)
        sweeper = Sweeper(redis, publish, publish_final, persist, stalls, sweep_config)
        tasks.add(asyncio.create_task(consumer.run(), name="token-consumer"))
        tasks.add(asyncio.create_task(sweep_forever(sweeper), name="sweep"))

    async def is_consuming() -> bool:
        return consumer is not None and consumer.is_running

    async def store_answers() -> bool:
        return await store_is_available(store)

    async def on_start() -> None:
        await store.start()

    async def on_stop() -> None:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        if stalls is not None:
            await stalls.stop()
        await store.close()

    runtime.bus.on_connect(start_watching)
    runtime.add_check("subscribed", is_consuming)
    runtime.add_check("store", store_answers)
    return create_app(runtime, on_start=on_start, on_stop=on_stop)
