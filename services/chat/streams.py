"""Replies read back outside the live stream: the text so far of a running reply, a whole stored
message as SSE once its log has expired, and a stored turn left running whose log is gone
(expired, or lost with Redis's data): it can never hear its final event, so the first read that
finds it settles it as failed with the text it has, and answers with that final state."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import replace

from redis.asyncio import Redis
from sse_starlette.sse import EventSourceResponse

from services.chat.errors import Gone, Unavailable
from services.chat.sse import SseEvent, error_data, meta_event, moderated_event, sse_response
from tandem.bus.events import ReplyStatus, finish_name, finish_of_status, now_ms, served_model
from tandem.runtime.request_id import current_request_id
from tandem.store import ConversationStore, Message
from tandem.tokenlog import load_reply, logged_events

log = logging.getLogger(__name__)
REPLY_FAILED = "the reply failed before it finished; the text it had is kept; regenerate it to try again"


async def as_logged(redis: Redis, store: ConversationStore, message: Message, grace_s: float) -> Message:
    """A message the store still has as running, as its token log has it now: the text so far,
    or its final text, status, tokens and served model when the reply ended before the relay stored it; failed
    (settled in the store) when its log is gone (see `is_starting` for `grace_s`)."""
    meta = await load_reply(redis, message.id)
    if meta is None:
        return await settle_lost_reply(store, message, grace_s)
    events = await logged_events(redis, message.id)
    text = "".join(event.text for event in events)
    if meta.is_running:
        return replace(message, content=text)
    tokens = events[-1].usage.output_tokens if events else 0
    if meta.status == ReplyStatus.MODERATED:  # withdrawn by the output check: its text is not shown
        text = ""
    # As the relay will store it: the version that wrote it, not the name the turn was asked with.
    return replace(message, content=text, status=meta.status, tokens=tokens, model=served_model(events) or message.model)


def is_starting(message: Message, grace_s: float) -> bool:
    """A running turn stored moments ago may not have its log yet (chat stores the turn, then
    records the reply in Redis): within `grace_s` it is not lost."""
    return now_ms() - message.created_at_ms < 1000 * grace_s


async def settle_lost_reply(store: ConversationStore, message: Message, grace_s: float, text: str | None = None) -> Message:
    """Stores a running turn whose log is gone as failed, with `text` (default: what the store
    has); the store keeps the first final write, so a turn the relay stored meanwhile stays as it
    was. Returns the turn as stored; a turn still starting comes back unchanged."""
    if message.status != ReplyStatus.RUNNING or is_starting(message, grace_s):
        return message
    content = message.content if text is None else text
    settled = await store.finish_message(
        message.conversation_id, message.id, content=content, status=ReplyStatus.FAILED, tokens=message.tokens
    )
    log.warning("reply %s: its log is gone while its turn was running; stored as failed", message.id)
    return settled or replace(message, content=content, status=ReplyStatus.FAILED)


async def _stored_events(message: Message) -> AsyncIterator[dict[str, str]]:
    yield meta_event(message.id, message.model).as_dict()
    yield SseEvent(2, "delta", {"text": message.content}).as_dict()
    yield _final_event(message, 3)


def _final_event(message: Message, event_id: int) -> dict[str, str]:
    if message.status == ReplyStatus.MODERATED:
        return moderated_event(event_id).as_dict()
    finish = finish_of_status(message.status)
    if finish is not None:
        usage = {"input": 0, "cached": 0, "output": message.tokens}
        return SseEvent(event_id, "done", {"finish": finish_name(finish), "usage": usage}).as_dict()
    message_text = REPLY_FAILED if message.status == ReplyStatus.FAILED else f"the reply ended as {message.status.value}"
    return SseEvent(event_id, "error", error_data(message.status.value, message_text, current_request_id())).as_dict()


async def _lost_reply_events(
    store: ConversationStore, message: Message, last_event_id: int, grace_s: float
) -> AsyncIterator[dict[str, str]]:
    """A running turn whose log is gone: settled, then its final state (the whole of it, or only
    the final event after the events a resuming client has)."""
    settled = await settle_lost_reply(store, message, grace_s)
    if last_event_id > 0:
        yield _final_event(settled, last_event_id + 1)
        return
    async for event in _stored_events(settled):
        yield event


def finished_message_response(
    store: ConversationStore, message: Message, last_event_id: int, *, grace_s: float, keepalive_s: float
) -> EventSourceResponse:
    """A message whose token log is gone: a finished one as stored; a running one (lost) settled
    as failed; one still starting is worth a retry in a moment."""
    if message.status == ReplyStatus.RUNNING:
        if is_starting(message, grace_s):
            raise Unavailable("the reply is starting; retry shortly", code="reply_unreadable", retry_after_s=1.0)
        return sse_response(_lost_reply_events(store, message, last_event_id, grace_s), keepalive_s, message.id)
    if last_event_id > 0:
        raise Gone("the reply's event log has expired: GET its conversation for the stored text", code="reply_expired")
    return sse_response(_stored_events(message), keepalive_s, message.id)
