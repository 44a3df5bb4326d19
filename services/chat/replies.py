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

from services.chat import metrics
from services.chat.sse import log_seq_to_resume_after, meta_event, sse_events
from services.chat.state import ChatState
from tandem.bus import decode, encode, subjects
from tandem.config import ApiKey, Tier
from tandem.tokenlog import RUNNING, ReplyKeys, ReplyMeta, attach, create_reply, detach, read
from tandem.v1.common_pb2 import LANE_FREE, LANE_PAID, SamplingParams
from tandem.v1.generate_pb2 import GenerateReply, GenerateRequest
from tandem.v1.tokens_pb2 import Cancel, TokenEvent

log = logging.getLogger(__name__)

# Router refusals as HTTP statuses; anything else is 503.
REFUSAL_STATUS = {
    "prompt_too_long": 413,
    "empty_prompt": 400,
    "bad_request": 400,
    "bad_sampling": 400,
    "bad_max_tokens": 400,
    "unknown_model": 404,
}


class ReplyRefused(Exception):
    def __init__(self, status_code: int, code: str, message: str, retry_after_s: float = 0.0) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


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
    """Records the reply and asks a router for it; raises ReplyRefused with an HTTP status."""
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
    try:
        client = state.bus.client
        answer = await client.request(subjects.GENERATE, encode(request), timeout=state.config.generate_timeout_s)
        outcome = decode(answer.data, GenerateReply)
    except Exception as exc:
        await forget_reply(state, reply.reply_id)
        metrics.REPLIES_REFUSED.labels(code="unavailable").inc()
        raise ReplyRefused(503, "unavailable", f"no router answered ({exc or type(exc).__name__}); try again shortly", 1.0) from None
    if outcome.WhichOneof("outcome") == "refused":
        await forget_reply(state, reply.reply_id)
        refusal = outcome.refused
        metrics.REPLIES_REFUSED.labels(code=refusal.reason).inc()
        status = REFUSAL_STATUS.get(refusal.reason, 503)
        raise ReplyRefused(status, refusal.reason, refusal.message, refusal.retry_after_s or (1.0 if status == 503 else 0.0))
    metrics.REPLIES_STARTED.labels(api="openai" if not reply.conversation_id else "chat", tier=reply.user.tier.value).inc()


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


async def sse_stream(
    state: ChatState, reply_id: str, model: str, last_event_id: int = 0, num_dropped_turns: int = 0
) -> AsyncIterator[dict[str, str]]:
    """The product's SSE events of a reply, after `last_event_id`."""
    if last_event_id >= 1:
        metrics.STREAM_RESUMES.inc()
    metrics.STREAMS_OPEN.inc()
    try:
        if last_event_id < 1:
            yield meta_event(reply_id, model, num_dropped_turns).as_dict()
        async for event in log_events(state, reply_id, log_seq_to_resume_after(last_event_id)):
            for sse in sse_events(event):
                if sse.id > last_event_id:
                    yield sse.as_dict()
    finally:
        metrics.STREAMS_OPEN.dec()
