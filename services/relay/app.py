"""Wiring of the relay process: every TokenEvent on `tandem.v1.tokens.>` (queue group, so
relays share the work) is appended to its reply's Redis token log; a reply's final event gets
its assistant turn stored; a sweep every second cancels replies nobody reads."""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI
from nats.aio.client import Client
from nats.aio.msg import Msg
from redis.exceptions import RedisError

from services.relay import metrics
from services.relay.persist import persist_reply
from services.relay.sweep import SweepConfig, Sweeper
from tandem.bus import BadMessage, decode, subjects
from tandem.config import Settings
from tandem.runtime import Runtime, RuntimeConfig, create_app
from tandem.store import StoreUnavailable, open_store, store_is_available
from tandem.tokenlog import RUNNING, TokenLogWriter
from tandem.v1.tokens_pb2 import TokenEvent

ROLE = "relay"
QUEUE_GROUP = "relay"
SWEEP_INTERVAL_S = 1.0
log = logging.getLogger(__name__)


def build_app(settings: Settings) -> FastAPI:
    runtime = Runtime(RuntimeConfig.from_settings(ROLE, settings, uses_redis=True))
    assert runtime.redis is not None
    redis = runtime.redis
    store = open_store(settings)
    writer = TokenLogWriter(redis, settings.token_log_ttl_s)
    tasks: set[asyncio.Task[None]] = set()
    is_subscribed = False

    async def persist(reply_id: str) -> bool:
        return await persist_reply(redis, store, reply_id, settings.token_log_ttl_s)

    async def on_token(msg: Msg) -> None:
        try:
            event = decode(msg.data, TokenEvent)
            appended = await writer.append(event)
        except (BadMessage, ValueError) as exc:
            metrics.EVENTS_DROPPED.labels(why="bad").inc()
            log.warning("dropped a token event on %s: %s", msg.subject, exc)
            return
        except Exception:  # Redis down: NATS will not redeliver, so say it loudly
            log.exception("could not log an event of reply %s", subjects.reply_id_of(msg.subject))
            return
        if appended.num_appended == 0:
            metrics.EVENTS_DROPPED.labels(why="duplicate_or_held").inc()
        metrics.EVENTS_LOGGED.inc(appended.num_appended)
        if appended.final_status is not None:
            metrics.REPLIES_FINISHED.labels(status=appended.final_status.value).inc()
            await redis.srem(RUNNING, event.reply_id)
            if not await persist(event.reply_id):
                metrics.REPLIES_UNPERSISTED.inc()

    async def publish(subject: str, data: bytes) -> None:
        await runtime.bus.client.publish(subject, data)

    sweeper = Sweeper(redis, publish, persist, SweepConfig(reader_idle_timeout_s=settings.reader_idle_timeout_s))

    async def sweep_forever() -> None:
        while True:
            try:
                await sweeper.sweep()
            except StoreUnavailable as exc:
                log.warning("sweep: store unavailable: %s", exc)
            except (RedisError, OSError) as exc:
                log.warning("sweep: redis unavailable: %s", exc)
            except Exception:  # a sweep must never stop for good
                log.exception("sweep failed")
            await asyncio.sleep(SWEEP_INTERVAL_S)

    async def subscribe(client: Client) -> None:
        nonlocal is_subscribed
        await client.subscribe(subjects.TOKENS_ALL, queue=QUEUE_GROUP, cb=on_token)
        await client.flush()
        is_subscribed = True

    async def has_subscribed() -> bool:
        return is_subscribed

    async def store_answers() -> bool:
        return await store_is_available(store)

    async def on_start() -> None:
        await store.start()
        tasks.add(asyncio.create_task(sweep_forever(), name="sweep"))

    async def on_stop() -> None:
        for task in tasks:
            task.cancel()
        await store.close()

    runtime.bus.on_connect(subscribe)
    runtime.add_check("subscribed", has_subscribed)
    runtime.add_check("store", store_answers)
    return create_app(runtime, on_start=on_start, on_stop=on_stop)
