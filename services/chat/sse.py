"""A reply's token log as the product's SSE events, numbered from 1 with `id:` lines:
`meta` is 1; the event of log seq s is a `delta` with id s+1; the final log event gives its
text as a delta (when it has any) and then `done` (or `error`), so ids stay contiguous and a
client resuming with Last-Event-ID N receives exactly the events after N. One helper builds
every such response."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

from sse_starlette.sse import EventSourceResponse

from services.chat.state import ChatState
from tandem.bus.events import finish_name, is_final
from tandem.v1.common_pb2 import FINISH_REASON_ERROR
from tandem.v1.tokens_pb2 import TokenEvent


@dataclass(frozen=True)
class SseEvent:
    id: int
    event: str
    data: dict[str, object]

    def as_dict(self) -> dict[str, str]:
        """For sse-starlette's EventSourceResponse."""
        return {"id": str(self.id), "event": self.event, "data": json.dumps(self.data, ensure_ascii=False)}


def meta_event(message_id: str, model: str, num_dropped_turns: int = 0) -> SseEvent:
    """`dropped_turns`: older turns of the conversation left out of the prompt to fit it."""
    return SseEvent(1, "meta", {"message_id": message_id, "model": model, "dropped_turns": num_dropped_turns})


def usage_of(event: TokenEvent) -> dict[str, int]:
    return {"input": event.usage.input_tokens, "cached": event.usage.cached_tokens, "output": event.usage.output_tokens}


def sse_events(event: TokenEvent) -> Iterator[SseEvent]:
    next_id = event.seq + 1
    if not is_final(event):
        yield SseEvent(next_id, "delta", {"text": event.text})
        return
    if event.text:
        yield SseEvent(next_id, "delta", {"text": event.text})
        next_id += 1
    if event.finish == FINISH_REASON_ERROR:
        error: dict[str, object] = {"code": event.error.code or "error", "message": event.error.message or "the reply failed"}
        if event.error.HasField("retry_after_s"):
            error["retry_after"] = event.error.retry_after_s
        yield SseEvent(next_id, "error", error)
        return
    yield SseEvent(next_id, "done", {"finish": finish_name(event.finish), "usage": usage_of(event)})


def log_seq_to_resume_after(last_event_id: int) -> int:
    """The log seq to read after so every SSE id above `last_event_id` is produced again."""
    return max(last_event_id - 2, 0)


def sse_response(state: ChatState, events: AsyncIterator[dict[str, str]], message_id: str = "") -> EventSourceResponse:
    """An SSE response with the configured keep-alive; `message_id` as X-Message-Id, so a client
    that loses the stream before the `meta` event still knows what to resume."""
    headers = {"X-Message-Id": message_id} if message_id else {}
    return EventSourceResponse(events, ping=int(state.config.keepalive_s), headers=headers)
