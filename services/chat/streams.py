"""Replies read back outside the live stream: the text so far of a running reply, and a whole
stored message as SSE once its log has expired."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from sse_starlette.sse import EventSourceResponse

from services.chat.errors import Gone, Unavailable
from services.chat.sse import SseEvent, meta_event, sse_response
from services.chat.state import ChatState
from tandem.bus.events import ReplyStatus, finish_name, finish_of_status
from tandem.store import Message
from tandem.tokenlog import load_reply, logged_events


async def as_logged(state: ChatState, message: Message) -> Message:
    """A message the store still has as running, as its token log has it now: the text so far,
    or its final text, status and tokens when the reply ended before the relay stored it."""
    meta = await load_reply(state.redis, message.id)
    if meta is None:
        return message
    events = await logged_events(state.redis, message.id)
    text = "".join(event.text for event in events)
    if meta.is_running:
        return replace(message, content=text)
    tokens = events[-1].usage.output_tokens if events else 0
    return replace(message, content=text, status=meta.status, tokens=tokens)


async def _stored_events(message: Message) -> AsyncIterator[dict[str, str]]:
    yield meta_event(message.id, message.model).as_dict()
    yield SseEvent(2, "delta", {"text": message.content}).as_dict()
    finish = finish_of_status(message.status)
    if finish is not None:
        usage = {"input": 0, "cached": 0, "output": message.tokens}
        yield SseEvent(3, "done", {"finish": finish_name(finish), "usage": usage}).as_dict()
    else:
        yield SseEvent(3, "error", {"code": message.status.value, "message": f"the reply ended as {message.status.value}"}).as_dict()


def finished_message_response(state: ChatState, message: Message, last_event_id: int) -> EventSourceResponse:
    if message.status == ReplyStatus.RUNNING:
        raise Unavailable("the reply is running but its log is not readable; retry shortly", code="reply_unreadable")
    if last_event_id > 0:
        raise Gone("the reply's event log has expired: GET its conversation for the stored text", code="reply_expired")
    return sse_response(state, _stored_events(message), message.id)
