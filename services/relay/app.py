"""Wiring of the relay process: every TokenEvent in the token stream (one durable JetStream
consumer that all relays share) is appended to its reply's Redis token log (and, with
redis_wait_replicas, is on that many replicas) and then acknowledged; a reply's final event gets
its assistant turn (a shadow reply's: its shadow answer) stored, its quota settled and its outcome published to the routers; a
sweep several times a second continues replies whose worker was lost and, about once a second,
cancels replies nobody reads and retries turns the store did not take, whose logs a loop of its
own keeps meanwhile (unstored.py). The output safety check
(moderation.py) reads each reply's newest text every few tokens and ends a reply that trips it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from fastapi import FastAPI
from nats.aio.client import Client
from redis.exceptions import RedisError

from services.relay.appender import LogAppender
from services.relay.consumer import TokenConsumer, TokenConsumerConfig
from services.relay.moderation import OutputCheckConfig, OutputModerator
from services.relay.outcomes import OutcomePublisher
from services.relay.persist import PersistConfig, Saved, save_or_keep
from services.relay.quotas import QuotaSettler
from services.relay.redis_memory import MemoryWatch
from services.relay.stalls import Claims, StallConfig, StallWatcher
from services.relay.sweep import SweepConfig, Sweeper
from services.relay.unstored import UnstoredConfig, keep_unstored
from tandem.bus.token_stream import publish_final as publish_final_event
from tandem.config import Settings
from tandem.quota import QuotaConfig, TokenBuckets
from tandem.runtime import Runtime, RuntimeConfig, create_app
from tandem.safety_process import CheckProcess
from tandem.store import StoreUnavailable, open_store, store_is_available
from tandem.tokenlog import TokenLogWriter
from tandem.tokenlog.replicated import ReplicationConfig
from tandem.v1.tokens_pb2 import TokenEvent

ROLE = "relay"
log = logging.getLogger(__name__)


def build_app(settings: Settings) -> FastAPI:
    runtime = Runtime(RuntimeConfig.from_settings(ROLE, settings, uses_redis=True))
    assert runtime.redis is not None
    redis = runtime.redis
    store = open_store(settings)
    writer = TokenLogWriter(redis, settings.token_log_ttl_s, running_ttl_s=settings.running_reply_ttl_s)
    # Acknowledged means on a replica too, where one is asked for (redis_wait_replicas).
    replication = ReplicationConfig(settings.redis_wait_replicas, settings.redis_wait_timeout_ms)
    persist_config = PersistConfig(ttl_s=settings.token_log_ttl_s, keep_s=settings.running_reply_ttl_s)
    unstored_config = UnstoredConfig(
        keep_s=max(settings.running_reply_ttl_s, settings.token_log_ttl_s),  # never shorter than the log would have had
        max_wait_s=settings.unstored_reply_max_wait_s,
        ttl_s=settings.token_log_ttl_s,
    )
    sweep_config = SweepConfig(reader_idle_timeout_s=settings.reader_idle_timeout_s)
    stall_config = StallConfig(
        stall_timeout_s=settings.stall_timeout_s,
        dispatch_grace_s=settings.dispatch_grace_s,
        max_continuations=settings.max_continuations,
        running_ttl_s=settings.running_reply_ttl_s,
    )
    claims = Claims()
    output_check = CheckProcess.start(settings.output_moderation, "TANDEM_OUTPUT_MODERATION")  # loaded once, in a process of its own
    moderator: OutputModerator | None = None
    quotas = QuotaSettler(redis, TokenBuckets(redis, QuotaConfig.from_settings(settings)))
    tasks: set[asyncio.Task[None]] = set()
    consumer: TokenConsumer | None = None
    stalls: StallWatcher | None = None

    async def publish(subject: str, data: bytes) -> None:
        await runtime.bus.client.publish(subject, data)

    outcomes = OutcomePublisher(publish)

    async def persist(reply_id: str) -> Saved:
        return await save_or_keep(redis, store, reply_id, persist_config, outcomes)

    async def persist_soon(reply_id: str) -> None:
        """Stores a finished reply without holding up the events behind it; the append listed it
        as unpersisted, so a sweep retries whatever fails here."""
        await persist(reply_id)

    async def keep_unstored_replies() -> None:
        await keep_unstored(redis, unstored_config)

    def on_finished(event: TokenEvent) -> None:
        spawn(persist_soon(event.reply_id), f"persist:{event.reply_id}")
        spawn(quotas.settle(event), f"quota:{event.reply_id}")

    def spawn(work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def publish_final(event: TokenEvent) -> None:
        await publish_final_event(runtime.bus.client.jetstream(), event)

    if output_check is not None:
        moderator = OutputModerator(redis, output_check, publish, publish_final, OutputCheckConfig.from_settings(settings))

    async def every(interval_s: float, work: Callable[[], Awaitable[None]], wake: asyncio.Event | None = None) -> None:
        """Runs `work` every interval, or as soon as `wake` is set."""
        while True:
            try:
                await work()
            except StoreUnavailable as exc:
                log.warning("sweep: store unavailable: %s", exc)
            except (RedisError, OSError) as exc:
                log.warning("sweep: redis unavailable: %s", exc)
            except Exception:  # a sweep must never stop for good
                log.exception("sweep failed")
            if wake is None:
                await asyncio.sleep(interval_s)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), interval_s)
            wake.clear()

    async def start_watching(client: Client) -> None:
        nonlocal consumer, stalls
        appender = LogAppender(writer, moderator, on_finished, replication)
        consumer = TokenConsumer(client, appender.append, TokenConsumerConfig())
        stalls = StallWatcher(redis, client, claims, publish_final, stall_config)
        await claims.listen(client)
        sweeper = Sweeper(redis, publish, publish_final, persist, stalls, sweep_config)
        spawn(consumer.run(), "token-consumer")
        spawn(every(sweep_config.stall_check_interval_s, sweeper.check_stalls, stalls.found_gone), "stalls")
        spawn(every(sweep_config.sweep_interval_s, sweeper.sweep), "sweep")
        spawn(every(sweep_config.sweep_interval_s, keep_unstored_replies), "unstored")  # never waits on the store
        spawn(every(settings.redis_memory_check_s, MemoryWatch(redis).read), "redis-memory")

    async def is_consuming() -> bool:
        return consumer is not None and consumer.is_running

    async def store_answers() -> bool:
        return await store_is_available(store)

    async def on_start() -> None:
        await store.start()

    async def on_stop() -> None:
        for task in list(tasks):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        if stalls is not None:
            await stalls.stop()
        if moderator is not None:
            await moderator.stop()
        await store.close()

    async def pull_again() -> None:
        if consumer is not None:
            await consumer.reconnected()

    runtime.bus.on_connect(start_watching)
    runtime.bus.on_reconnect(pull_again)
    runtime.add_check("subscribed", is_consuming)
    runtime.add_check("store", store_answers)
    return create_app(runtime, on_start=on_start, on_stop=on_stop)
