"""What the relay checks every second: replies nobody reads (cancelled), cancelled replies
whose worker never answered (closed by the relay itself), replies not yet stored (retried),
and gaps in a log that do not fill (reported)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from redis.asyncio import Redis

from services.relay import metrics
from tandem.bus import encode, subjects
from tandem.bus.events import cancelled_event, now_ms
from tandem.tokenlog import RUNNING, UNPERSISTED, ReplyKeys, as_text, idle_for_ms, load_reply
from tandem.v1.tokens_pb2 import Cancel

log = logging.getLogger(__name__)

Publish = Callable[[str, bytes], Awaitable[None]]
Persist = Callable[[str], Awaitable[bool]]


@dataclass(frozen=True)
class SweepConfig:
    reader_idle_timeout_s: float = 30.0
    cancel_grace_s: float = 10.0  # a cancelled reply still running after this is closed by the relay
    gap_report_s: float = 5.0


class Sweeper:
    def __init__(self, redis: Redis, publish: Publish, persist: Persist, config: SweepConfig) -> None:
        self._redis = redis
        self._publish = publish
        self._persist = persist
        self._config = config

    async def sweep(self) -> None:
        for raw in await self._redis.smembers(RUNNING):
            await self._check_running(as_text(raw))
        for raw in await self._redis.smembers(UNPERSISTED):
            await self._persist(as_text(raw))

    async def _check_running(self, reply_id: str) -> None:
        meta = await load_reply(self._redis, reply_id)
        if meta is None or not meta.is_running:
            await self._redis.srem(RUNNING, reply_id)
            return
        keys = ReplyKeys(reply_id)
        gap_since_ms = int(await self._redis.hget(keys.meta, "gap_since_ms") or 0)
        if gap_since_ms and now_ms() - gap_since_ms > self._config.gap_report_s * 1000:
            metrics.GAPS_REPORTED.inc()
            log.warning(
                "reply %s: events after seq %d wait for a missing one since %d ms", reply_id, meta.last_seq, now_ms() - gap_since_ms
            )
        cancel_sent_ms = int(await self._redis.hget(keys.meta, "cancel_sent_ms") or 0)
        if cancel_sent_ms:
            if now_ms() - cancel_sent_ms > self._config.cancel_grace_s * 1000:
                await self._close(reply_id, meta.last_seq)
            return
        if await idle_for_ms(self._redis, reply_id) < self._config.reader_idle_timeout_s * 1000:
            return
        # One relay sends the cancel; the others see the mark.
        if await self._redis.hsetnx(keys.meta, "cancel_sent_ms", now_ms()):
            metrics.IDLE_CANCELS.inc()
            log.info("reply %s: nobody has read it for %.0f s; cancelling", reply_id, self._config.reader_idle_timeout_s)
            await self._publish(subjects.cancel(reply_id), encode(Cancel(reply_id=reply_id, reason="no_reader")))

    async def _close(self, reply_id: str, last_seq: int) -> None:
        """No worker ended the cancelled reply: the relay writes its final event so it ends as stopped."""
        log.warning("reply %s: no worker ended it after the cancel; closing its log", reply_id)
        await self._publish(subjects.tokens(reply_id), encode(cancelled_event(reply_id, last_seq + 1, worker_id="relay")))
