"""Starting, streaming and stopping a reply. A reply is recorded in the token log before its
request is sent (so its first token always finds it), answered by the router over NATS, and
read back from the log by whichever chat instance the client reaches."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import nats.errors
from sse_starlette.sse import EventSourceResponse

from services.chat import metrics
from services.chat.errors import ChatError, InvalidRequest, NotFound, TooLarge, Unavailable
from services.chat.sse import SseEvent, log_seq_to_resume_after, meta_event, sse_events, sse_response
from services.chat.state import ChatState
from services.chat.streams import settle_lost_reply
from tandem.bus import BadMessage, decode, encode, subjects
from tandem.config import ApiKey, Tier
from tandem.tokenlog import RUNNING, ReplyGone, ReplyKeys, ReplyMeta, attach, create_reply, detach, read
from tandem.v1.common_pb2 import LANE_FREE, LANE_PAID, SamplingParams
from tandem.v1.generate_pb2 import GenerateReply, GenerateRequest
from tandem.v1.tokens_pb2 import Cancel, TokenEvent

log = logging.getLogger(__name__)

# A router's refusal as the chat service's error (its reason is the error's code); any other
# reason is Unavailable.
REFUSALS: dict[str, type[ChatError]] = {
    "prompt_too_long": TooLarge,
    "empty_prompt": InvalidRequest,
    "bad_request": InvalidRequest,
    "bad_sampling": InvalidRequest,
    "bad_max_tokens": InvalidRequest,
    "unknown_model": NotFound,
}
ROUTER_RETRY_AFTER_S = 2.0
REPLY_EXPIRED = "this reply's token log expired (or was lost) before it was read to the end; GET its conversation for the stored text"


def new_reply_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class ReplyRequest:
    reply_id: str
    user: ApiKey
    model: str
    prompt_ids: list[int]
    public_prefix_tokens: int
    sampling: SamplingParams
    conversation_id: str = ""
    message_id: str = ""  # the assistant message, stored as running, that the reply fills


async def begin_reply(state: ChatState, reply: ReplyRequest) -> None:
    """Records the reply and asks a router for it; raises a ChatError (its code the router's reason)
    when the router refuses it or none answers, and then nothing of it is kept."""
    request = GenerateRequest(
        request_id=reply.reply_id,
        reply_id=reply.reply_id,
        model=reply.model,
        user_id=reply.user.user_id,
        tenant=reply.user.user_id,
        conversation_id=reply.conversation_id,
        lane=LANE_FREE if reply.user.tier == Tier.FREE else LANE_PAID,
        prompt_token_ids=reply.prompt_ids,
        public_prefix_tokens=reply.public_prefix_tokens,
        sampling=reply.sampling,
    )
    meta = ReplyMeta(
        reply_id=reply.reply_id,
        user_id=reply.user.user_id,
        conversation_id=reply.conversation_id,
        message_id=reply.message_id,
        model=reply.model,
        request=request.SerializeToString(),
    )
    await create_reply(state.redis, meta, track_readers=True)
    outcome = await _ask_router(state, request)
    if outcome.WhichOneof("outcome") == "refused":
        await forget_reply(state, reply.reply_id)
        refusal = outcome.refused
        metrics.REPLIES_REFUSED.labels(code=refusal.reason).inc()
        kind = REFUSALS.get(refusal.reason, Unavailable)
        raise kind(refusal.message, code=refusal.reason, retry_after_s=refusal.retry_after_s)
    metrics.REPLIES_STARTED.labels(api="openai" if not reply.conversation_id else "chat", tier=reply.user.tier.value).inc()


async def _ask_router(state: ChatState, request: GenerateRequest) -> GenerateReply:
    """The router's answer; raises Unavailable (503 with Retry-After) when none came. A request
    that may have reached a router (it timed out, or the connection failed meanwhile) is
    cancelled too, so no generation runs that nobody tracks."""
    timeout_s = state.config.generate_timeout_s
    if not state.bus.is_connected:  # reconnecting: nothing is sent, so nothing to cancel
        await forget_reply(state, request.reply_id)
        raise Unavailable("the message bus is reconnecting; try again shortly", code="bus_unavailable", retry_after_s=ROUTER_RETRY_AFTER_S)
    try:
        answer = await state.bus.client.request(subjects.GENERATE, encode(request), timeout=timeout_s)
        return decode(answer.data, GenerateReply)
    except nats.errors.NoRespondersError:
        error = Unavailable("no router is running; try again shortly", code="no_router", retry_after_s=ROUTER_RETRY_AFTER_S)
    except nats.errors.TimeoutError:
        message = f"no router answered within {timeout_s:g} s; try again shortly"
        error = Unavailable(message, code="router_timeout", retry_after_s=ROUTER_RETRY_AFTER_S)
        await _cancel_untracked(state, request.reply_id)
    except (nats.errors.Error, BadMessage) as exc:
        message = f"the router could not be asked ({exc or type(exc).__name__}); try again shortly"
        error = Unavailable(message, code="router_unavailable", retry_after_s=ROUTER_RETRY_AFTER_S)
        await _cancel_untracked(state, request.reply_id)
    await forget_reply(state, request.reply_id)
    metrics.REPLIES_REFUSED.labels(code=error.code).inc()
    raise error


async def _cancel_untracked(state: ChatState, reply_id: str) -> None:
    try:
        await cancel_reply(state, reply_id, "generate_timeout")
    except nats.errors.Error as exc:  # NATS is down: nothing reaches a router either
        log.warning("could not cancel reply %s after its generate request failed: %s", reply_id, exc or type(exc).__name__)


async def forget_reply(state: ChatState, reply_id: str) -> None:
    """A reply that never started: nothing to keep."""
    await state.redis.srem(RUNNING, reply_id)
    await state.redis.delete(*ReplyKeys(reply_id).all())


async def cancel_reply(state: ChatState, reply_id: str, reason: str) -> None:
    await state.bus.client.publish(subjects.cancel(reply_id), encode(Cancel(reply_id=reply_id, reason=reason)))


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
