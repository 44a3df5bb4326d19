"""Asking the model for a conversation's summary: a GenerateRequest on the background lane,
greedy and bounded, recorded in the token log with no conversation or message (so the relay
stores no turn for it) and with no quota reserved, then read from its log until its final event.

The background lane runs only on idle capacity: the router refuses it while its overload ladder
is at rung 1 or more, and a worker refuses it while its queue is not empty (the reply then ends
with an "overloaded" error). Either is a refusal: asked again after its retry time, while the
job's deadline allows."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import nats.errors
from redis.asyncio import Redis

from services.chat.fanout import FanoutHub
from services.chat.replies import cancel_reply, forget_reply, new_reply_id
from services.chat.streaming import log_events
from services.chat.summary_prompt import tidy
from tandem.bus import Bus, encode, subjects, validate
from tandem.bus.events import ReplyStatus, status_of_finish
from tandem.config import ApiKey
from tandem.tokenlog import LogUnavailable, ReplyGone, ReplyMeta, create_reply, load_reply_states
from tandem.v1.common_pb2 import FINISH_REASON_ERROR, FINISH_REASON_LENGTH, LANE_BACKGROUND, SamplingParams
from tandem.v1.generate_pb2 import GenerateRequest
from tandem.v1.tokens_pb2 import TokenEvent

log = logging.getLogger(__name__)
OVERLOADED = "overloaded"  # the stable code of a refusal for want of capacity (the router's, or a worker's through it)
MIN_RETRY_WAIT_S = 1.0
MAX_RETRY_WAIT_S = 10.0
TURN_POLL_S = 0.5


class NoSummary(Exception):
    """The model wrote no summary; `is_refused`: the fleet had no idle capacity for it."""

    def __init__(self, why: str, *, is_refused: bool = False, retry_after_s: float = 0.0) -> None:
        self.is_refused = is_refused
        self.retry_after_s = retry_after_s
        super().__init__(why)


@dataclass(frozen=True)
class SummaryRequest:
    user: ApiKey
    conversation_id: str
    model: str  # the conversation's served model
    prompt_ids: list[int]
    max_tokens: int


class SummaryAsker:
    """Asks the routers for summaries over `bus`, and reads them back through `fanout`."""

    def __init__(self, redis: Redis, bus: Bus, fanout: FanoutHub, generate_timeout_s: float) -> None:
        self._redis = redis
        self._bus = bus
        self._fanout = fanout
        self._generate_timeout_s = generate_timeout_s

    async def wait_for_turn(self, reply_id: str) -> None:
        """Until the turn's reply has ended (or its log is gone), so that the summary asks for
        capacity after the answer the user is waiting for, not beside it. Its status is polled:
        reading its log would count as a reader and keep a reply nobody reads alive."""
        while True:
            meta = (await load_reply_states(self._redis, [reply_id]))[reply_id]
            if meta is None or not meta.is_running:
                return
            await asyncio.sleep(TURN_POLL_S)

    async def ask(self, request: SummaryRequest, deadline: float) -> str:
        """The model's summary; a refusal is asked again after its retry time while that falls
        before `deadline` (the event loop's time), else raised as NoSummary like any failure."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                return await self._ask_once(request)
            except NoSummary as exc:
                wait_s = min(max(exc.retry_after_s, MIN_RETRY_WAIT_S), MAX_RETRY_WAIT_S)
                if not exc.is_refused or loop.time() + wait_s >= deadline:
                    raise
                log.debug("conversation %s: summary refused (%s); asking again in %.1f s", request.conversation_id, exc, wait_s)
                await asyncio.sleep(wait_s)

    async def _ask_once(self, request: SummaryRequest) -> str:
        reply_id = new_reply_id()
        generate = GenerateRequest(
            request_id=reply_id,
            reply_id=reply_id,
            model=request.model,
            user_id=request.user.user_id,
            tenant=request.user.user_id,  # the user's text: cached in the user's own namespace only
            conversation_id=request.conversation_id,  # placed where the conversation's turns are
            lane=LANE_BACKGROUND,
            prompt_token_ids=request.prompt_ids,
            sampling=SamplingParams(temperature=0.0, max_tokens=request.max_tokens),
        )
        meta = ReplyMeta(reply_id=reply_id, user_id=request.user.user_id, model=request.model, request=generate.SerializeToString())
        await create_reply(self._redis, meta, track_readers=False)
        try:
            answer = await self._bus.client.request(subjects.GENERATE, encode(generate), timeout=self._generate_timeout_s)
            outcome = validate.generate_reply(answer.data)
        except (nats.errors.Error, validate.Invalid) as exc:
            await forget_reply(self._redis, reply_id)
            if isinstance(exc, nats.errors.TimeoutError):  # it may have reached a router
                await cancel_reply(self._bus, reply_id, "generate_timeout")
            raise NoSummary(f"the router could not be asked ({type(exc).__name__})") from exc
        if outcome.WhichOneof("outcome") == "refused":
            await forget_reply(self._redis, reply_id)
            refusal = outcome.refused
            raise NoSummary(
                f"{refusal.reason}: {refusal.message}", is_refused=refusal.reason == OVERLOADED, retry_after_s=refusal.retry_after_s
            )
        return await self._read_summary(reply_id)

    async def _read_summary(self, reply_id: str) -> str:
        """The reply's text, as stored, once it ends complete; its worker is told to stop if this read is
        cancelled (the job's deadline, or this process stopping)."""
        text: list[str] = []
        final: TokenEvent | None = None
        try:
            async for event in log_events(self._fanout, reply_id):
                text.append(event.text)
                final = event
        except (ReplyGone, LogUnavailable) as exc:
            raise NoSummary(f"its token log could not be read ({type(exc).__name__})") from exc
        except asyncio.CancelledError:
            with contextlib.suppress(nats.errors.Error):
                await cancel_reply(self._bus, reply_id, "summary_cancelled")
            raise
        if final is None or not final.finish:
            raise NoSummary("its log ended without a final event")
        if final.finish == FINISH_REASON_ERROR:
            error = final.error
            raise NoSummary(f"{error.code}: {error.message}", is_refused=error.code == OVERLOADED, retry_after_s=error.retry_after_s)
        status = status_of_finish(final.finish)
        if status != ReplyStatus.COMPLETE:
            raise NoSummary(f"its reply ended {status.value}")
        summary = tidy("".join(text), is_cut_at_length=final.finish == FINISH_REASON_LENGTH)
        if not summary:
            raise NoSummary("the model wrote an empty summary")
        return summary
