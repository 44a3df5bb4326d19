"""Saves a finished reply as its conversation's assistant turn: the logged text, the status, the
output token count and the model its final event names, whether or not any client is connected when it ends.

The append that closes a reply's log also lists it as unpersisted, in the same step; it leaves
that set only here, once its turn is stored (or it has none). While the store is down the reply
stays listed, its log's expiry is pushed back on every try, and each sweep tries again, so nothing
acknowledged to the user is lost."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from redis.asyncio import Redis

from tandem.bus.events import ReplyStatus
from tandem.store import ConversationStore, StoreUnavailable
from tandem.tokenlog import REPLY_SET_TTL_S, UNPERSISTED, ReplyKeys, load_reply, logged_events

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PersistConfig:
    ttl_s: int  # a stored reply's log stays readable this long (settings.token_log_ttl_s)
    keep_s: int  # an unstored one's log is kept at least this long from each try (settings.running_reply_ttl_s)


async def persist_reply(redis: Redis, store: ConversationStore, reply_id: str, config: PersistConfig) -> bool:
    """True when the reply is stored, has no conversation to be stored in, or is gone."""
    meta = await load_reply(redis, reply_id)
    if meta is None or meta.is_running:
        if meta is None:
            log.warning("reply %s: its log expired before it was stored", reply_id)
        await redis.srem(UNPERSISTED, reply_id)  # gone, or not closed (its final append lists it again)
        return True
    if not meta.conversation_id or not meta.message_id:
        await redis.srem(UNPERSISTED, reply_id)  # the OpenAI endpoint's or a bus client's: no turn to store
        return True
    events = await logged_events(redis, reply_id)  # complete: its final event is logged
    # A moderated reply is stored without the text that tripped the output check.
    text = "" if meta.status == ReplyStatus.MODERATED else "".join(event.text for event in events)
    num_output_tokens = events[-1].usage.output_tokens if events else 0
    # The served model the worker's final event names (a router's or relay's final names none).
    model = next((event.model for event in reversed(events) if event.model), "")
    keys = ReplyKeys(reply_id)
    try:
        await store.finish_message(
            meta.conversation_id, meta.message_id, content=text, status=meta.status, tokens=num_output_tokens, model=model
        )
    except StoreUnavailable as exc:
        log.warning("reply %s is not stored yet (%s); the log is kept until it is", reply_id, exc)
        async with redis.pipeline(transaction=True) as pipe:
            pipe.sadd(UNPERSISTED, reply_id)
            pipe.expire(UNPERSISTED, REPLY_SET_TTL_S)
            for key in (keys.log, keys.meta):
                pipe.expire(key, config.keep_s)
            await pipe.execute()
        return False
    async with redis.pipeline(transaction=True) as pipe:
        pipe.srem(UNPERSISTED, reply_id)
        for key in (keys.log, keys.meta):
            pipe.expire(key, config.ttl_s)
        await pipe.execute()
    return True
