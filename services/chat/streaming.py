"""Streaming a reply to a client: its token log read live, as the product's SSE events."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

from sse_starlette.sse import EventSourceResponse

from services.chat import metrics
from services.chat.sse import SseEvent, log_seq_to_resume_after, meta_event, sse_events, sse_response
from services.chat.state import ChatState
from services.chat.streams import settle_lost_reply
from tandem.tokenlog import ReplyGone, attach, detach, read
from tandem.v1.tokens_pb2 import TokenEvent

log = logging.getLogger(__name__)
REPLY_EXPIRED = "this reply's token log expired (or was lost) before it was read to the end; GET its conversation for the stored text"


async def _renew_lease(state: ChatState, reply_id: str, reader_id: str) -> None:
    while True:
        await attach(state.redis, reply_id, reader_id, state.config.reader_lease_s)
        await asyncio.sleep(state.config.reader_lease_s / 3)


@contextlib.asynccontextmanager
async def reading(state: ChatState, reply_id: str) -> AsyncIterator[None]:
    """Holds a reader lease on the reply while the block runs, so the relay knows someone reads."""
    reader_id = f"{state.instance_id}:{uuid.uuid4().hex[:8]}"
    await attach(state.redis, reply_id, reader_id, state.config.reader_lease_s)
    renewer = asyncio.create_task(_renew_lease(state, reply_id, reader_id), name=f"lease:{reply_id}")
    try:
        yield
    finally:
        renewer.cancel()
        with contextlib.suppress(Exception):
            await asyncio.shield(detach(state.redis, reply_id, reader_id))


async def log_events(state: ChatState, reply_id: str, after_seq: int = 0) -> AsyncIterator[TokenEvent]:
    """The reply's TokenEvents after `after_seq`, live, while holding a reader lease."""
    async with reading(state, reply_id):
        async for event in read(state.stream_redis, reply_id, after=after_seq):
            yield event


def reply_response(state: ChatState, reply_id: str, model: str, last_event_id: int = 0, num_dropped_turns: int = 0) -> EventSourceResponse:
    """The SSE response of a reply read from its log, after `last_event_id`."""
    return sse_response(state, sse_stream(state, reply_id, model, last_event_id, num_dropped_turns), reply_id)


async def sse_stream(
    state: ChatState, reply_id: str, model: str, last_event_id: int = 0, num_dropped_turns: int = 0
) -> AsyncIterator[dict[str, str]]:
    """The product's SSE events of a reply, after `last_event_id`. A log that vanishes before its
    final event ends the stream with an `error` event, code "reply_expired", and its stored turn,
    if it has one still running, is settled as failed with the text it had."""
    if last_event_id >= 1:
        metrics.STREAM_RESUMES.inc()
    metrics.STREAMS_OPEN.inc()
    last_id = last_event_id
    after_seq = log_seq_to_resume_after(last_event_id)
    text: list[str] = []  # the whole text so far when read from the log's start
    try:
        if last_event_id < 1:
            last_id = 1
            yield meta_event(reply_id, model, num_dropped_turns).as_dict()
        try:
            async for event in log_events(state, reply_id, after_seq):
                text.append(event.text)
                for sse in sse_events(event):
                    if sse.id > last_event_id:
                        last_id = sse.id
                        yield sse.as_dict()
        except ReplyGone:
            log.info("reply %s: its log vanished while a client read it", reply_id)
            await _settle_stored_turn(state, reply_id, "".join(text) if after_seq == 0 else None)
            yield SseEvent(last_id + 1, "error", {"code": "reply_expired", "message": REPLY_EXPIRED}).as_dict()
    finally:
        metrics.STREAMS_OPEN.dec()


async def _settle_stored_turn(state: ChatState, reply_id: str, text: str | None) -> None:
    """The stored turn of a reply whose log vanished (none for an OpenAI reply): failed, with `text`."""
    message = await state.store.get_message(reply_id)
    if message is not None:
        await settle_lost_reply(state, message, text)
