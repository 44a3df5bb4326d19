"""A reply's token log as the product's SSE events, numbered from 1 with `id:` lines:
`meta` is 1; the event of log seq s is a `delta` with id s+1; the final log event gives its
text as a delta (when it has any) and then `done` (or `error`; or only `moderated`, for a reply
the output check withdrew), so ids stay contiguous and a
client resuming with Last-Event-ID N receives exactly the events after N. One helper builds
every such response. A live reply's events are encoded to bytes once (services.chat.fanout) and
written as they are: sse-starlette passes `bytes` through unchanged.

An `error` event carries a stable code, a message for people and the request id, never
internals. Whoever wrote the failure into the token log (the router, the relay), every client
that reads it is told the id of its own request, the one in its X-Request-Id header: a reply is
read by many requests (the one that started it, resumes, other tabs), and the chat's log names
each request's reply, so a client's report finds both. So an error event is encoded per client
(Frames.is_per_request), not once for all."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from sse_starlette import ServerSentEvent
from sse_starlette.sse import EventSourceResponse, SendTimeoutError
from starlette.types import Message, Receive, Scope, Send

from services.chat.direct_write import DirectWriter
from tandem.bus.events import finish_name, is_final
from tandem.runtime.request_id import SERVER_SEND
from tandem.v1.common_pb2 import FINISH_REASON_CONTENT_FILTER, FINISH_REASON_ERROR
from tandem.v1.tokens_pb2 import TokenEvent

log = logging.getLogger(__name__)
SEPARATOR = EventSourceResponse.DEFAULT_SEPARATOR  # "\r\n": the product's events (bench/stream_clients.py reads them so)
# The OpenAI-compatible streams end their lines in "\n", as OpenAI's and vLLM's servers do: the
# SSE format allows "\r\n" too, but clients that split events on "\n\n" (vLLM's `bench serve`)
# lose every event that shares a read with another, the usage chunk among them.
OPENAI_SEPARATOR = "\n"
# What a reader of a reply the output check withdrew is told (the `moderated` event).
WITHDRAWN = (
    "This answer was withdrawn: the safety check stopped it while it was being written, and the text shown so far is hidden. "
    "You can rephrase your message and try again."
)
# A client that takes no bytes for this many keep-alives is gone: its stream ends and frees its slot.
SEND_TIMEOUT_KEEPALIVES = 2


@dataclass(frozen=True)
class SseEvent:
    id: int
    event: str
    data: dict[str, object]

    def as_dict(self) -> dict[str, str]:
        """For sse-starlette's EventSourceResponse."""
        return {"id": str(self.id), "event": self.event, "data": json.dumps(self.data, ensure_ascii=False)}

    def encode(self) -> bytes:
        """As the response writes it."""
        data = json.dumps(self.data, ensure_ascii=False)
        return ServerSentEvent(data=data, event=self.event, id=str(self.id), sep=SEPARATOR).encode()


@dataclass(frozen=True)
class Frames:
    """The SSE events of one TokenEvent, encoded: each (id, bytes), and all of them in one `blob`."""

    each: tuple[tuple[int, bytes], ...]
    blob: bytes
    is_per_request: bool = False  # it ends with an `error` event, which names the request streaming it

    @property
    def first_id(self) -> int:
        return self.each[0][0]


def encode_frames(event: TokenEvent, request_id: str = "") -> Frames:
    """`request_id`: the request an error event is streamed to (see the module's docstring)."""
    each = tuple((sse.id, sse.encode()) for sse in sse_events(event, request_id))
    return Frames(each, b"".join(data for _, data in each), is_per_request=event.finish == FINISH_REASON_ERROR)


def meta_event(message_id: str, model: str, num_dropped_turns: int = 0, route: dict[str, object] | None = None) -> SseEvent:
    """`dropped_turns`: older turns of the conversation left out of the prompt to fit it; `route`:
    how the model was chosen (services.chat.model_routing), on the stream of the request that chose it."""
    data: dict[str, object] = {"message_id": message_id, "model": model, "dropped_turns": num_dropped_turns}
    if route is not None:
        data["route"] = route
    return SseEvent(1, "meta", data)


def moderated_event(event_id: int) -> SseEvent:
    """Ends a reply the output check withdrew, instead of `done`: the client hides the text it showed."""
    return SseEvent(event_id, "moderated", {"message": WITHDRAWN, "finish": finish_name(FINISH_REASON_CONTENT_FILTER)})


def usage_of(event: TokenEvent) -> dict[str, int]:
    return {"input": event.usage.input_tokens, "cached": event.usage.cached_tokens, "output": event.usage.output_tokens}


def error_data(code: str, message: str, request_id: str) -> dict[str, object]:
    """What an `error` event says: a stable code, a message for people, the id of the request it is streamed to."""
    return {"code": code, "message": message, "request_id": request_id}


def sse_events(event: TokenEvent, request_id: str = "") -> Iterator[SseEvent]:
    """`request_id` is named by an `error` event (the request it is streamed to)."""
    next_id = event.seq + 1
    if not is_final(event):
        yield SseEvent(next_id, "delta", {"text": event.text})
        return
    if event.finish == FINISH_REASON_CONTENT_FILTER:  # any text it carries is withdrawn with the rest
        yield moderated_event(next_id)
        return
    if event.text:
        yield SseEvent(next_id, "delta", {"text": event.text})
        next_id += 1
    if event.finish == FINISH_REASON_ERROR:
        error = error_data(event.error.code or "error", event.error.message or "the reply failed", request_id)
        if event.error.HasField("retry_after_s"):
            error["retry_after"] = event.error.retry_after_s
        yield SseEvent(next_id, "error", error)
        return
    done: dict[str, object] = {"finish": finish_name(event.finish), "usage": usage_of(event)}
    if event.model:  # the served model that wrote it (a worker's final names it)
        done["model"] = event.model
    if event.stop_reason:  # what ended it where the finish does not say ("repetition")
        done["stop_reason"] = event.stop_reason
    yield SseEvent(next_id, "done", done)


def log_seq_to_resume_after(last_event_id: int) -> int:
    """The log seq to read after so every SSE id above `last_event_id` is produced again."""
    return max(last_event_id - 2, 0)


class WriterSlot:
    """Where a response leaves its DirectWriter for its body, which reads it once iterated (when the
    server has called the response); made first and handed to both."""

    writer: DirectWriter | None = None


class StreamResponse(EventSourceResponse):
    """An EventSourceResponse that runs its `on_close` callbacks however it ends (its body may
    never have started), and ends quietly for a client that stopped taking bytes. With a
    `writer_slot`, its body's producer may write live events to the connection itself, and a
    keep-alive is left out when such writes reached the client since the last one: with thousands
    of streams, keep-alives to streams busy with events are loop time spent for nothing.
    A keep-alive still goes to a client the server holds writes for (the connection paused): its
    timed send is what ends the stream of a client that stopped reading."""

    def __init__(self, *args: object, writer_slot: WriterSlot | None = None, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._on_close: list[Callable[[], None]] = []
        self._server_send: Send | None = None
        self._writer_slot = writer_slot
        self._writes_at_keepalive = 0  # the writer's count when the last keep-alive was due

    def on_close(self, callback: Callable[[], None]) -> None:
        self._on_close.append(callback)

    async def _send_with_timeout(self, send: Send, message: Message) -> None:
        """Events go straight to the server's send: no middleware wrappers and no timer per
        write (thousands of streams, each written every few tokens); keep-alives (comments, b":")
        and the response's start and end go the whole way, timed."""
        body = message.get("body", b"")
        if self._server_send is not None and message.get("more_body") and body[:1] != b":":
            await self._server_send(message)
            return
        if body[:1] == b":" and self._was_written_since_keepalive():
            return
        await super()._send_with_timeout(send, message)

    def _was_written_since_keepalive(self) -> bool:
        """Whether events were written straight to a connection that takes them, since the last
        keep-alive was due."""
        writer = self._writer_slot.writer if self._writer_slot is not None else None
        if writer is None or writer.is_paused:
            return False
        previous, self._writes_at_keepalive = self._writes_at_keepalive, writer.num_writes
        return writer.num_writes != previous

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.ping_interval > 0:  # a client that stops reading is found by a ping's timed send
            self._server_send = scope.get("state", {}).get(SERVER_SEND)
            if self._writer_slot is not None:
                self._writer_slot.writer = DirectWriter.of(self._server_send)
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            log.info("an SSE client took nothing for %.0f s: its stream ends", self.send_timeout or 0)
        finally:
            for callback in self._on_close:
                callback()


def sse_response(
    events: AsyncIterator[dict[str, str]] | AsyncIterator[bytes],
    keepalive_s: float,
    message_id: str = "",
    writer_slot: WriterSlot | None = None,
    sep: str = SEPARATOR,
) -> StreamResponse:
    """An SSE response with a keep-alive every `keepalive_s`; `message_id` as X-Message-Id, so a
    client that loses the stream before the `meta` event still knows what to resume."""
    headers = {"X-Message-Id": message_id} if message_id else {}
    return StreamResponse(
        events, ping=int(keepalive_s), headers=headers, send_timeout=SEND_TIMEOUT_KEEPALIVES * keepalive_s, writer_slot=writer_slot, sep=sep
    )
