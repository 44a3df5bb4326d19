"""Saves a finished reply, whether or not any client is connected when it ends: its usage in the
ledger (ledger.py: every billed reply, the OpenAI endpoint's too) and, when it has a conversation,
its assistant turn: the logged text, the status, the output token count and the model its final
event names. Both writes are idempotent by reply id, so a retried save counts nothing twice.

The append that closes a reply's log also lists it as unpersisted, in the same step; it leaves
that set only here, once it is saved (or has nothing to save). While the store is down the reply
stays listed, its log's expiry is pushed back on every try, and each sweep tries again, so nothing
acknowledged to the user is lost, and no reply goes uncounted."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from redis.asyncio import Redis

from services.relay.ledger import reply_usage
from tandem.bus.events import ReplyStatus
from tandem.store import ConversationStore, StoreUnavailable
from tandem.tokenlog import REPLY_SET_TTL_S, UNPERSISTED, ReplyKeys, ReplyMeta, load_reply, logged_events
from tandem.tokenlog.reader import entry_id
from tandem.v1.tokens_pb2 import TokenEvent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PersistConfig:
    ttl_s: int  # a stored reply's log stays readable this long (settings.token_log_ttl_s)
    keep_s: int  # an unstored one's log is kept at least this long from each try (settings.running_reply_ttl_s)


async def persist_reply(redis: Redis, store: ConversationStore, reply_id: str, config: PersistConfig) -> bool:
    """True when the reply is saved, has nothing to save, or is gone."""
    meta = await load_reply(redis, reply_id)
    if meta is None or meta.is_running:
        if meta is None:
            log.warning("reply %s: its log expired before it was stored", reply_id)
        await redis.srem(UNPERSISTED, reply_id)  # gone, or not closed (its final append lists it again)
        return True
    has_turn = bool(meta.conversation_id and meta.message_id)  # none: the OpenAI endpoint's or a bus client's
    # Complete: its final event is logged. A turn needs the whole text, the ledger the final event only.
    events = await logged_events(redis, reply_id, since="-" if has_turn else entry_id(meta.last_seq))
    usage = reply_usage(meta, events[-1]) if events else None
    if usage is None and not has_turn:
        await redis.srem(UNPERSISTED, reply_id)
        return True
    keys = ReplyKeys(reply_id)
    try:
        if usage is not None:
            await store.record_usage(usage)
        if has_turn:
            await _store_turn(store, meta, events)
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


async def _store_turn(store: ConversationStore, meta: ReplyMeta, events: list[TokenEvent]) -> None:
    # A moderated reply is stored without the text that tripped the output check.
    text = "" if meta.status == ReplyStatus.MODERATED else "".join(event.text for event in events)
    num_output_tokens = events[-1].usage.output_tokens if events else 0
    # The served model the worker's final event names (a router's or relay's final names none).
    model = next((event.model for event in reversed(events) if event.model), "")
    await store.finish_message(
        meta.conversation_id, meta.message_id, content=text, status=meta.status, tokens=num_output_tokens, model=model
    )
