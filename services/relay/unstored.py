"""Finished replies waiting for the store (the unpersisted set). Once a sweep interval, in a loop
of its own that never waits on the store, every waiting reply's log and meta get their expiry
pushed back (one pipelined call for all of them), so a store outage of any length loses no
finished reply however long each retry takes; their number and the oldest one's wait are
exported for the alert; and a reply that has waited past the bound is given up on (an error log
and a counter), so a store that never comes back cannot keep the set growing for ever."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from redis.asyncio import Redis

from services.relay import metrics
from tandem.bus.events import now_ms
from tandem.tokenlog import REPLY_SET_TTL_S, UNPERSISTED, ReplyKeys, as_text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnstoredConfig:
    keep_s: int  # each pass keeps a waiting reply's log and meta this long (at least a running reply's expiry)
    max_wait_s: int  # a reply finished longer ago than this is given up on (settings.unstored_reply_max_wait_s)
    ttl_s: int  # a given-up reply's log stays readable this long, as a stored one's does (settings.token_log_ttl_s)


@dataclass(frozen=True)
class Waiting:
    """What one pass found: the replies still waiting and the oldest one's wait, and those given up."""

    num_replies: int
    oldest_wait_s: float
    given_up: tuple[str, ...]


async def keep_unstored(redis: Redis, config: UnstoredConfig) -> Waiting:
    """Pushes back every waiting reply's expiry, gives up on those past the bound, and exports
    what is left. A member whose meta is gone is left to the sweep, which drops it."""
    reply_ids = sorted(as_text(raw) for raw in await redis.smembers(UNPERSISTED))
    async with redis.pipeline(transaction=False) as pipe:
        for reply_id in reply_ids:
            keys = ReplyKeys(reply_id)
            pipe.expire(keys.log, config.keep_s)
            pipe.expire(keys.meta, config.keep_s)
            pipe.hget(keys.meta, "finished_ms")
        if reply_ids:
            pipe.expire(UNPERSISTED, REPLY_SET_TTL_S)
        answers = await pipe.execute()
    now = now_ms()
    finished_ms = {reply_id: int(raw) for reply_id, raw in zip(reply_ids, answers[2::3], strict=True) if raw is not None}
    given_up = tuple(reply_id for reply_id, finished in finished_ms.items() if now - finished > config.max_wait_s * 1000)
    if given_up:
        await _give_up(redis, given_up, config)
    waits_ms = [now - finished for reply_id, finished in finished_ms.items() if reply_id not in given_up]
    waiting = Waiting(num_replies=len(reply_ids) - len(given_up), oldest_wait_s=max(waits_ms, default=0) / 1000, given_up=given_up)
    metrics.REPLIES_WAITING_FOR_STORE.set(waiting.num_replies)
    metrics.OLDEST_WAIT_FOR_STORE.set(waiting.oldest_wait_s)
    return waiting


async def _give_up(redis: Redis, reply_ids: tuple[str, ...], config: UnstoredConfig) -> None:
    for reply_id in reply_ids:
        log.error(
            "reply %s: the store has not taken it for over %d s (TANDEM_UNSTORED_REPLY_MAX_WAIT_S); giving up on storing it",
            reply_id,
            config.max_wait_s,
        )
    metrics.REPLIES_GIVEN_UP.inc(len(reply_ids))
    async with redis.pipeline(transaction=True) as pipe:
        pipe.srem(UNPERSISTED, *reply_ids)
        for reply_id in reply_ids:
            keys = ReplyKeys(reply_id)
            for key in (keys.log, keys.meta):
                pipe.expire(key, config.ttl_s)
        await pipe.execute()
