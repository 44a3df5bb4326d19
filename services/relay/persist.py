"""Saves a finished reply as its conversation's assistant turn: the logged text, the status and
the output token count, whether or not any client is connected when it ends.

When the store is down, the reply joins the unpersisted set and its log stops expiring until a
later sweep stores it, so nothing acknowledged to the user is lost."""

from __future__ import annotations

import logging

from redis.asyncio import Redis

from tandem.store import ConversationStore, StoreUnavailable
from tandem.tokenlog import UNPERSISTED, ReplyKeys, load_reply, logged_events

log = logging.getLogger(__name__)


async def persist_reply(redis: Redis, store: ConversationStore, reply_id: str, ttl_s: int) -> bool:
    """True when the reply is stored (or has no conversation to be stored in)."""
    meta = await load_reply(redis, reply_id)
    if meta is None or meta.is_running:
        return True  # expired (nothing left to save) or not finished yet
    if not meta.conversation_id or not meta.message_id:
        return True  # a reply of the OpenAI endpoint or a bus client: not a conversation turn
    events = await logged_events(redis, reply_id)  # complete: its final event is logged
    text = "".join(event.text for event in events)
    num_output_tokens = events[-1].usage.output_tokens if events else 0
    keys = ReplyKeys(reply_id)
    try:
        await store.finish_message(meta.conversation_id, meta.message_id, content=text, status=meta.status, tokens=num_output_tokens)
    except StoreUnavailable as exc:
        log.warning("reply %s is not stored yet (%s); the log is kept until it is", reply_id, exc)
        async with redis.pipeline(transaction=True) as pipe:
            pipe.sadd(UNPERSISTED, reply_id)
            for key in (keys.log, keys.meta):
                pipe.persist(key)
            await pipe.execute()
        return False
    async with redis.pipeline(transaction=True) as pipe:
        pipe.srem(UNPERSISTED, reply_id)
        for key in (keys.log, keys.meta):
            pipe.expire(key, ttl_s)
        await pipe.execute()
    return True
