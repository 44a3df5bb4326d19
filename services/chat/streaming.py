"""Streaming a reply to a client: its token log read live through this instance's feed of the
reply (services.chat.fanout), as the product's SSE events, written as pre-encoded bytes with
everything queued for the client in one write. While the client keeps up, the feed writes its
live events to the connection itself (services.chat.direct_write), except to the stream of the
request that started the reply, whose writes its ReplyClock times."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator

from redis.asyncio import Redis
from sse_starlette.sse import EventSourceResponse

from services.chat import metrics
from services.chat.config import ChatConfig
from services.chat.fanout import FanoutHub
from services.chat.latency import ReplyClock
from services.chat.sse import SseEvent, StreamResponse, WriterSlot, error_data, log_seq_to_resume_after, meta_event, sse_response
from services.chat.streams import as_logged, finished_message_response, settle_lost_reply
from tandem.bus.events import is_final
from tandem.runtime.request_id import current_request_id
from tandem.store import ConversationStore, Message
from tandem.tokenlog import ReplyGone, ReplyMeta
from tandem.v1.common_pb2 import FINISH_REASON_ERROR
from tandem.v1.tokens_pb2 import TokenEvent

log = logging.getLogger(__name__)
REPLY_EXPIRED = "this reply's token log expired (or was lost) before it was read to the end; GET its conversation for the stored text"


async def log_events(fanout: FanoutHub, reply_id: str) -> AsyncGenerator[TokenEvent, None]:
    """The reply's TokenEvents from its first, live, ending after the final one. Raises ReplyGone
    when its log vanishes, LogUnavailable when Redis stays away. Never dropped: for a client that
    cannot resume (the OpenAI endpoints), whose reply's events the feed keeps anyway."""
    async with fanout.subscribe(reply_id) as subscription:
        async for event in subscription.events():
            yield event


class ReplyStreams:
    """The product's SSE streams of replies on this instance: read through its `fanout`, with a
    keep-alive every `keepalive_s`; a client more than `max_lag_events` live events behind is
    dropped (it resumes); a stored turn whose log is gone is settled in `store` once it is older
    than `lost_reply_grace_s` (services.chat.streams)."""

    def __init__(
        self,
        fanout: FanoutHub,
        redis: Redis,
        store: ConversationStore,
        *,
        keepalive_s: float,
        max_lag_events: int,
        lost_reply_grace_s: float,
    ) -> None:
        self._fanout = fanout
        self._redis = redis
        self._store = store
        self._keepalive_s = keepalive_s
        self._max_lag_events = max_lag_events
        self._grace_s = lost_reply_grace_s

    @classmethod
    def of(cls, fanout: FanoutHub, redis: Redis, store: ConversationStore, config: ChatConfig) -> ReplyStreams:
        return cls(
            fanout,
            redis,
            store,
            keepalive_s=config.keepalive_s,
            max_lag_events=config.stream_buffer_events,
            lost_reply_grace_s=config.lost_reply_grace_s,
        )

    def response(
        self,
        reply_id: str,
        model: str,
        last_event_id: int = 0,
        num_dropped_turns: int = 0,
        clock: ReplyClock | None = None,
        route: dict[str, object] | None = None,
        meta: ReplyMeta | None = None,
    ) -> StreamResponse:
        """The SSE response of a reply read from its log, after `last_event_id`; `clock` measures it
        for the request that started the reply, whose `meta` event says how its model was chosen
        (`route`); `meta`: the reply's log meta, when the caller read it."""
        slot = WriterSlot() if clock is None else None
        events = self.sse_stream(reply_id, model, last_event_id, num_dropped_turns, clock, route, slot, meta=meta)
        response = sse_response(events, self._keepalive_s, reply_id, slot)
        if clock is not None:
            response.on_close(clock.close)
        return response

    def logged_response(self, meta: ReplyMeta, last_event_id: int = 0) -> StreamResponse:
        """The SSE response of a reply already started (a resumed or attached stream), whose `meta`
        event says what the first stream's said."""
        route = json.loads(meta.route_json) if meta.route_json else None
        return self.response(meta.reply_id, meta.model, last_event_id, meta.num_dropped_turns, route=route, meta=meta)

    def finished_response(self, message: Message, last_event_id: int) -> EventSourceResponse:
        """The SSE response of a message whose token log is gone (services.chat.streams)."""
        return finished_message_response(self._store, message, last_event_id, grace_s=self._grace_s, keepalive_s=self._keepalive_s)

    async def as_logged(self, message: Message) -> Message:
        """A running message as its token log has it now (services.chat.streams)."""
        return await as_logged(self._redis, self._store, message, self._grace_s)

    async def sse_stream(
        self,
        reply_id: str,
        model: str,
        last_event_id: int = 0,
        num_dropped_turns: int = 0,
        clock: ReplyClock | None = None,
        route: dict[str, object] | None = None,
        writer_slot: WriterSlot | None = None,
        *,
        meta: ReplyMeta | None = None,
    ) -> AsyncIterator[bytes]:
        """The product's SSE events of a reply after `last_event_id`, as bytes. A client that falls
        `max_lag_events` live events behind is dropped: its stream ends and it resumes with
        Last-Event-ID. A log that vanishes before its final event ends the stream with an `error`
        event, code "reply_expired", and its stored turn, if it has one still running, is settled as
        failed with the text the feed read. Every `error` event names this request's id (its
        X-Request-Id), whoever wrote the failure into the log. `writer_slot`: its response's, whose
        DirectWriter (if any) the feed may write live events with; `meta`: the reply's, for the feed
        to keep (FanoutHub.running_meta)."""
        request_id = current_request_id()  # the response streams in a task that inherits the request's context
        if last_event_id >= 1:
            metrics.STREAM_RESUMES.inc()
        last_id = last_event_id
        if last_event_id < 1:
            last_id = 1
            yield meta_event(reply_id, model, num_dropped_turns, route).encode()
        after_seq = log_seq_to_resume_after(last_event_id)
        writer = writer_slot.writer if writer_slot is not None else None
        async with self._fanout.subscribe(
            reply_id, after_seq=after_seq, max_lag=self._max_lag_events, last_sse_id=last_id, writer=writer, meta=meta
        ) as subscription:
            feed = subscription.feed
            try:
                async for start, stop in subscription.ranges():
                    data = feed.sse_bytes(start, stop, subscription.last_sse_id, request_id)
                    subscription.last_sse_id = max(subscription.last_sse_id, feed.frames[stop - 1].each[-1][0])
                    if data:
                        yield data
                        if clock is not None:
                            _clock_write(clock, feed.events[start:stop])
                        _log_failure(request_id, feed.events[stop - 1])
            except ReplyGone:
                log.info("request %s: reply %s: its log vanished while the client read it", request_id, reply_id)
                text = feed.text if feed.events else None
                await feed.once(lambda: self._settle_stored_turn(reply_id, text))
                if clock is not None:
                    clock.close("expired")
                error = error_data("reply_expired", REPLY_EXPIRED, request_id)
                yield SseEvent(subscription.last_sse_id + 1, "error", error).encode()

    async def _settle_stored_turn(self, reply_id: str, text: str | None) -> None:
        """The stored turn of a reply whose log vanished (none for an OpenAI reply): failed, with `text`."""
        message = await self._store.get_message(reply_id)
        if message is not None:
            await settle_lost_reply(self._store, message, self._grace_s, text)


def _log_failure(request_id: str, event: TokenEvent) -> None:
    """A client told that its reply failed can quote the request id: the log ties it to the reply,
    whose details the router's or relay's log has under the reply id."""
    if event.finish == FINISH_REASON_ERROR:
        log.info("request %s: reply %s ended with error %s", request_id, event.reply_id, event.error.code)


def _clock_write(clock: ReplyClock, events: list[TokenEvent]) -> None:
    """A write of these events has reached the client: its content, and its end if it ends the reply."""
    if any(event.text for event in events):
        clock.content()
    if events and is_final(events[-1]):
        clock.final(events[-1])
