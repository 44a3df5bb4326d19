"""What the relay checks about running replies, several times a second: stalled replies (their
worker lost: continued, see stalls.py); and once a second: replies nobody reads (cancelled,
only those created to track their readers), cancelled replies whose worker never answered (closed
by the relay itself), replies not yet stored (retried: past one whose own save fails, up to the
store not answering), gaps in a log that do not fill (reported), and members of the reply sets
whose reply is gone (dropped)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from redis.asyncio import Redis

from services.relay import metrics
from services.relay.persist import Saved
from services.relay.stalls import StallWatcher
from tandem.bus import encode, subjects
from tandem.bus.events import cancelled_event, now_ms
from tandem.tokenlog import REPLY_SET_TTL_S, RUNNING, UNPERSISTED, ReplyKeys, ReplyMeta, as_text, idle_for_ms, load_reply_states
from tandem.v1.tokens_pb2 import Cancel, TokenEvent

log = logging.getLogger(__name__)

Publish = Callable[[str, bytes], Awaitable[None]]
PublishFinal = Callable[[TokenEvent], Awaitable[None]]
Persist = Callable[[str], Awaitable[Saved]]  # never raises (persist.py's save_or_keep)


@dataclass(frozen=True)
class SweepConfig:
    reader_idle_timeout_s: float = 30.0
    cancel_grace_s: float = 10.0  # a cancelled reply still running after this is closed by the relay
    gap_report_s: float = 5.0
    stall_check_interval_s: float = 0.25
    sweep_interval_s: float = 1.0


class Sweeper:
    """Two loops' work: `check_stalls` (cheap, frequent) and `sweep` (the rest, which may wait on
    the store), so a store outage never delays finding a lost worker."""

    def __init__(
        self, redis: Redis, publish: Publish, publish_final: PublishFinal, persist: Persist, stalls: StallWatcher, config: SweepConfig
    ) -> None:
        self._redis = redis
        self._publish = publish
        self._publish_final = publish_final
        self._persist = persist
        self._stalls = stalls
        self._config = config

    async def _running(self) -> dict[str, ReplyMeta | None]:
        reply_ids = sorted(as_text(raw) for raw in await self._redis.smembers(RUNNING))
        return await load_reply_states(self._redis, reply_ids) if reply_ids else {}

    async def check_stalls(self) -> None:
        states = await self._running()
        self._stalls.check(meta for meta in states.values() if meta is not None and meta.is_running)

    async def sweep(self) -> None:
        states = await self._running()
        gone = [reply_id for reply_id, meta in states.items() if meta is None or not meta.is_running]
        if gone:
            await self._redis.srem(RUNNING, *gone)
        if states:
            await self._redis.expire(RUNNING, REPLY_SET_TTL_S)
        for meta in states.values():
            if meta is not None and meta.is_running:
                await self._check_running(meta)
        for reply_id in sorted(as_text(raw) for raw in await self._redis.smembers(UNPERSISTED)):
            metrics.PERSIST_RETRIES.inc()
            if await self._persist(reply_id) is Saved.STORE_DOWN:
                break  # the next sweep tries again; a failure of one reply's own goes on to the others

    async def _check_running(self, meta: ReplyMeta) -> None:
        reply_id = meta.reply_id
        if meta.gap_since_ms and now_ms() - meta.gap_since_ms > self._config.gap_report_s * 1000:
            metrics.GAPS_REPORTED.inc()
            log.warning(
                "reply %s: events after seq %d wait for a missing one since %d ms", reply_id, meta.last_seq, now_ms() - meta.gap_since_ms
            )
        if meta.cancel_sent_ms:
            if now_ms() - meta.cancel_sent_ms > self._config.cancel_grace_s * 1000:
                await self._close(meta)
            return
        if not meta.is_tracking_readers:
            return
        if await idle_for_ms(self._redis, reply_id) < self._config.reader_idle_timeout_s * 1000:
            return
        # One relay sends the cancel; the others see the mark.
        if await self._redis.hsetnx(ReplyKeys(reply_id).meta, "cancel_sent_ms", now_ms()):
            metrics.IDLE_CANCELS.inc()
            log.info("reply %s: nobody has read it for %.0f s; cancelling", reply_id, self._config.reader_idle_timeout_s)
            await self._publish(subjects.cancel(reply_id), encode(Cancel(reply_id=reply_id, reason="no_reader")))

    async def _close(self, meta: ReplyMeta) -> None:
        """No worker ended the cancelled reply: the relay writes its final event so it ends as stopped."""
        log.warning("reply %s: no worker ended it after the cancel; closing its log", meta.reply_id)
        event = cancelled_event(meta.reply_id, meta.last_seq + 1, worker_id="relay")
        event.epoch = meta.epoch
        await self._publish_final(event)
