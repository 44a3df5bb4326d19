"""Saves a finished reply, whether or not any client is connected when it ends: its usage in the
ledger (ledger.py: every billed reply, the OpenAI endpoint's too) and, when it has a conversation,
its assistant turn: the logged text, the status, the output token count and the model its final
event names. A shadow reply (GenerateRequest.shadow_of: a rollout's candidate answering a mirrored
request) is neither billed nor a turn: its answer is stored as a ShadowAnswer beside the reply it
mirrors. Every write is idempotent by reply id, so a retried save counts nothing twice. Once
saved, the reply's outcome goes to the routers (outcomes.py).

The append that closes a reply's log also lists it as unpersisted, in the same step; it leaves
that set only here, once it is saved (or has nothing to save). While the store is down the reply
stays listed, each sweep tries it again (a failure of one reply, of any kind, never stops the
others), and its log's expiry is pushed back for as long as it waits (unstored.py), so nothing
acknowledged to the user is lost, and no reply goes uncounted."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import Enum

from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.relay import metrics
from services.relay.ledger import reply_usage
from services.relay.outcomes import OutcomePublisher, reply_outcome
from tandem.bus.events import ReplyStatus, finish_name, is_final, served_model
from tandem.store import ConversationStore, ShadowAnswer, StoreUnavailable
from tandem.tokenlog import REPLY_SET_TTL_S, UNPERSISTED, ReplyKeys, ReplyMeta, load_reply, logged_events
from tandem.tokenlog.reader import entry_id
from tandem.v1.generate_pb2 import GenerateRequest
from tandem.v1.tokens_pb2 import TokenEvent
from tandem.v1.worker_pb2 import ReplyOutcome

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PersistConfig:
    ttl_s: int  # a stored reply's log stays readable this long (settings.token_log_ttl_s)
    keep_s: int  # an unstored one's log is kept at least this long from each try (settings.running_reply_ttl_s)


class Saved(Enum):
    STORED = "stored"  # or nothing to store, or gone
    KEPT = "kept"  # this reply's save failed: it waits for the next sweep; the others are tried
    STORE_DOWN = "store_down"  # the store (or Redis) did not answer: the others would fail alike


async def save_or_keep(redis: Redis, store: ConversationStore, reply_id: str, config: PersistConfig, outcomes: OutcomePublisher) -> Saved:
    """persist_reply that never raises: a reply not stored stays in the unpersisted set, for the
    next sweep. Told apart by type: the store unavailable or Redis not answering (a sweep stops
    trying the others: each would wait out the same timeout; their logs are kept meanwhile by
    unstored.py), or an error of this reply's save (logged with its traceback; the others go on)."""
    try:
        saved = Saved.STORED if await persist_reply(redis, store, reply_id, config, outcomes) else Saved.STORE_DOWN
    except RedisError as exc:
        log.warning("reply %s: not stored yet, Redis did not answer (%s); a sweep retries", reply_id, exc)
        saved = Saved.STORE_DOWN
    except Exception:  # a store error not mapped to StoreUnavailable, a bad record: this reply only
        log.exception("reply %s: storing it failed; a sweep retries", reply_id)
        saved = Saved.KEPT
    if saved is not Saved.STORED:
        metrics.REPLIES_UNPERSISTED.inc()
    return saved


async def persist_reply(redis: Redis, store: ConversationStore, reply_id: str, config: PersistConfig, outcomes: OutcomePublisher) -> bool:
    """True when the reply is saved, has nothing to save, or is gone. A closed reply's outcome is
    published once it is saved (or has nothing to save)."""
    meta = await load_reply(redis, reply_id)
    if meta is None or meta.is_running:
        if meta is None:
            log.warning("reply %s: its log expired before it was stored", reply_id)
        await redis.srem(UNPERSISTED, reply_id)  # gone, or not closed (its final append lists it again)
        return True
    request = GenerateRequest.FromString(meta.request)
    shadow_of = request.shadow_of
    has_turn = bool(meta.conversation_id and meta.message_id) and not shadow_of  # none: the OpenAI endpoint's or a bus client's
    # Complete: its final event is logged. A turn or a shadow answer needs the whole text, the
    # ledger the final event only, the outcome the first event as well.
    needs_text = has_turn or bool(shadow_of)
    events = await logged_events(redis, reply_id, since="-" if needs_text else entry_id(meta.last_seq))
    first = events[0] if needs_text else next(iter(await logged_events(redis, reply_id, until=entry_id(1))), None)
    final = events[-1] if events else None
    outcome = reply_outcome(meta, shadow_of=shadow_of, first=first, final=final)
    usage = reply_usage(meta, final) if final is not None else None  # never a shadow's: it is background work
    if usage is None and not needs_text:
        await redis.srem(UNPERSISTED, reply_id)
        await outcomes.publish(outcome)
        return True
    try:
        if usage is not None:
            await store.record_usage(usage)
        if has_turn:
            await _store_turn(store, meta, events)
        if shadow_of:
            await store.record_shadow_answer(_shadow_answer(meta, request, events, outcome))
    except StoreUnavailable as exc:
        log.warning("reply %s is not stored yet (%s); the log is kept until it is", reply_id, exc)
        await _keep_for_retry(redis, reply_id, config)
        return False
    await _release(redis, reply_id, config)
    if shadow_of:
        metrics.SHADOW_ANSWERS.labels(status=meta.status.value).inc()
    await outcomes.publish(outcome)
    return True


async def _keep_for_retry(redis: Redis, reply_id: str, config: PersistConfig) -> None:
    """Lists the reply as unstored (a sweep tries again) and keeps its log meanwhile."""
    keys = ReplyKeys(reply_id)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.sadd(UNPERSISTED, reply_id)
        pipe.expire(UNPERSISTED, REPLY_SET_TTL_S)
        for key in (keys.log, keys.meta):
            pipe.expire(key, config.keep_s)
        await pipe.execute()


async def _release(redis: Redis, reply_id: str, config: PersistConfig) -> None:
    """The reply is stored: off the unstored list, its log readable for ttl_s more."""
    keys = ReplyKeys(reply_id)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.srem(UNPERSISTED, reply_id)
        for key in (keys.log, keys.meta):
            pipe.expire(key, config.ttl_s)
        await pipe.execute()


def _text(meta: ReplyMeta, events: list[TokenEvent]) -> str:
    # A moderated reply is stored without the text that tripped the output check.
    return "" if meta.status == ReplyStatus.MODERATED else "".join(event.text for event in events)


def _shadow_answer(meta: ReplyMeta, request: GenerateRequest, events: list[TokenEvent], outcome: ReplyOutcome) -> ShadowAnswer:
    final = events[-1] if events and is_final(events[-1]) else None
    num_output_tokens = 0 if final is None else final.usage.output_tokens or max(0, final.seq - 1)  # no usage: an error's
    return ShadowAnswer(
        reply_id=meta.reply_id,
        shadow_of=request.shadow_of,
        user_id=meta.user_id or request.user_id,
        conversation_id=request.conversation_id,
        model=outcome.model,
        text=_text(meta, events),
        num_output_tokens=num_output_tokens,
        status=meta.status,
        finish="" if final is None else finish_name(final.finish),
        stop_reason="" if final is None else final.stop_reason,
        ttft_s=outcome.ttft_s,
        created_ms=meta.created_ms,
        finished_ms=meta.finished_ms,
    )


async def _store_turn(store: ConversationStore, meta: ReplyMeta, events: list[TokenEvent]) -> None:
    num_output_tokens = events[-1].usage.output_tokens if events else 0
    await store.finish_message(
        meta.conversation_id,
        meta.message_id,
        content=_text(meta, events),
        status=meta.status,
        tokens=num_output_tokens,
        model=served_model(events),
    )
