"""Starting and stopping a reply. A reply is recorded in the token log before its
request is sent (so its first token always finds it), answered by the router over NATS, and
read back from the log (services.chat.streaming) by whichever chat instance the client reaches.

A reply whose user's quota cannot afford it is refused with 429 quota_exceeded, unless it carries
a fallback (the same prompt to the small model; services.chat.model_routing.quota_fallback) and
its tier falls back (tandem.quota.QuotaConfig.falls_back): then the fallback starts instead,
drawing on the small model's own bucket, and only that bucket's exhaustion is the 429."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, replace
from typing import Protocol

import nats.errors
from nats.aio.msg import Msg
from redis.asyncio import Redis

from services.chat import metrics, quotas
from services.chat.door import Door
from services.chat.errors import ChatError, InvalidRequest, NotFound, TooLarge, Unavailable
from services.chat.model_routing import Route, record_route
from services.chat.shadow import Shadows
from tandem.bus import Bus, encode, subjects, validate
from tandem.config import ApiKey, Tier
from tandem.quota import Bucket, TokenBuckets
from tandem.runtime.request_id import current_request_id
from tandem.tokenlog import RUNNING, ReplyKeys, ReplyMeta, create_reply, set_answered
from tandem.v1.common_pb2 import LANE_FREE, LANE_PAID, SamplingParams
from tandem.v1.generate_pb2 import GenerateReply, GenerateRequest
from tandem.v1.tokens_pb2 import Cancel

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
NO_ROUTER_FIRST_RETRY_S = 0.05  # a generate that found no router is sent again after this, doubling
NO_ROUTER_MAX_RETRY_S = 0.5


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
    num_dropped_turns: int = 0  # older turns of the conversation left out of the prompt
    route: Route | None = None  # how its model was chosen (model auto)
    # Awaited once the reply is recorded, before its request is sent; raises to refuse it (nothing
    # of it is kept, its reservation given back): the input check's verdict, which the OpenAI
    # endpoints wait for here so that the rest of its wait overlaps the quota's and the log's
    # round trips instead of coming before them.
    cleared: Callable[[], Awaitable[None]] | None = None
    # The same reply to the small model, started instead when the user's quota cannot afford this
    # one and the tier falls back (None: a 429 then); its route says why (quota_fallback).
    fallback: ReplyRequest | None = None


@dataclass(frozen=True)
class Begun:
    """A started reply: the model the router admitted it for and how it was chosen (None: not by
    services.chat.model_routing)."""

    model: str
    route: Route | None = None


class StoredTurn(Protocol):
    """The stored turn a product reply fills (an OpenAI reply has none)."""

    async def store(self, reply: ReplyRequest) -> None:
        """Writes the turn of `reply` (the one whose quota was reserved: the asked one or its
        fallback): after the reservation, before the reply is recorded or asked for."""

    async def refuse(self, error: ChatError) -> None:
        """The reply will never run (the router refused it, or none answered): the turn is settled."""


class ReplyStarter:
    """The one way a reply starts, for the product and the OpenAI endpoints alike: the overload
    door, the quota reservation and the router's request, each once, in that order."""

    def __init__(
        self, redis: Redis, bus: Bus, door: Door, quotas: TokenBuckets | None, generate_timeout_s: float, shadows: Shadows | None = None
    ) -> None:
        self._redis = redis
        self._shadows = shadows  # starts the shadow replies the rollout asks for; None: none start
        self._bus = bus
        self._door = door
        self._quotas = quotas  # None: no quotas apply
        self._generate_timeout_s = generate_timeout_s

    async def start_reply(self, reply: ReplyRequest, turn: StoredTurn | None = None) -> Begun:
        """Refuses it at the door while its model's free lane is closed; reserves its worst case in
        the user's quota (or its fallback's in the small model's bucket); stores `turn`; records the
        reply and asks a router for it. Returns the model the router admitted it for (another
        pool's when the asked one is down or full: services.router.pools) and its route. Raises a
        ChatError (RateLimited when the quota cannot afford it yet; the router's reason as its code
        when the router refuses it or none answers), and then nothing of the reply is kept, its
        reservation is given back and `turn`, if stored, refused."""
        self._door.check(reply.model, reply.user.tier)
        reply = await self._reserve(reply)
        async with self._refunded_on_error(reply.reply_id):
            if turn is None:
                return await self._begin(reply)
            await turn.store(reply)
            try:
                return await self._begin(reply)
            except ChatError as exc:
                await turn.refuse(exc)
                raise

    async def start_choices(self, choices: Sequence[ReplyRequest], prompt_cached: Callable[[str], Awaitable[None]]) -> Begun:
        """Starts several replies to one prompt (OpenAI's `n`): every one's worst case is reserved
        first, so a quota that affords fewer starts none; the first begins alone, the others once
        `prompt_cached(first's reply id)` returns (its first token is out: its prompt's full blocks
        are in its worker's prefix cache, which the router's prefix index steers the others to and
        their prefill reads instead of computing). Begun one after another: each is a log write and
        a router round trip. Returns the first's model and route; raises as start_reply does, and then the
        replies already begun are cancelled and every reservation given back. Choices never fall
        back to the small model (one request, one model: all or none would have to)."""
        first = choices[0]
        self._door.check(first.model, first.user.tier)
        async with contextlib.AsyncExitStack() as reservations:
            for choice in choices:
                await self._reserve(replace(choice, fallback=None))
                await reservations.enter_async_context(self._refunded_on_error(choice.reply_id))
            begun = await self._begin(first)
            begun_ids = [first.reply_id]
            try:
                await prompt_cached(first.reply_id)
                for choice in choices[1:]:
                    await self._begin(choice)
                    begun_ids.append(choice.reply_id)
            except BaseException:
                for reply_id in begun_ids:
                    with contextlib.suppress(nats.errors.Error):  # NATS is down: nothing reaches a worker either
                        await cancel_reply(self._bus, reply_id, "choice_not_started")
                raise
        return begun

    async def _reserve(self, reply: ReplyRequest) -> ReplyRequest:
        """Reserves the reply's worst case in the user's main bucket and returns `reply`; when that
        bucket cannot afford it and the reply has a fallback its tier may take, reserves the
        fallback's in the small model's bucket and returns the fallback. Raises as quotas.reserve."""
        if self._quotas is None:
            return reply
        try:
            await quotas.reserve(self._quotas, reply.user, reply.reply_id, len(reply.prompt_ids), reply.sampling.max_tokens)
            return reply
        except quotas.QuotaExhausted as exhausted:
            fallback = reply.fallback if self._quotas.config.falls_back(reply.user.tier) else None
            if fallback is None:
                metrics.REPLIES_REFUSED.labels(code=exhausted.code).inc()
                raise
            refusal = exhausted
        self._door.check(fallback.model, fallback.user.tier)
        try:
            await quotas.reserve(
                self._quotas, fallback.user, fallback.reply_id, len(fallback.prompt_ids), fallback.sampling.max_tokens, Bucket.SMALL
            )
        except InvalidRequest:  # more than the whole small bucket: the main one's refusal is the honest answer
            metrics.REPLIES_REFUSED.labels(code=refusal.code).inc()
            raise refusal from None
        except quotas.QuotaExhausted as exhausted:
            metrics.REPLIES_REFUSED.labels(code=exhausted.code).inc()
            raise
        if fallback.route is not None:
            record_route(fallback.route, fallback.user)
        return fallback

    def _refunded_on_error(self, reply_id: str) -> AbstractAsyncContextManager[None]:
        if self._quotas is None:
            return contextlib.nullcontext()
        return quotas.refunded_on_error(self._quotas, reply_id)

    async def _begin(self, reply: ReplyRequest) -> Begun:
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
            num_dropped_turns=reply.num_dropped_turns,
        )
        await create_reply(self._redis, meta, track_readers=True)
        if reply.cleared is not None:
            try:
                await reply.cleared()
            except BaseException:
                await forget_reply(self._redis, reply.reply_id)
                raise
        outcome = await self.ask_router(request)
        if outcome.WhichOneof("outcome") == "refused":
            await forget_reply(self._redis, reply.reply_id)
            refusal = outcome.refused
            metrics.REPLIES_REFUSED.labels(code=refusal.reason).inc()
            self._door.refused(reply.model, reply.user.tier, refusal.reason, refusal.retry_after_s, refusal.message)
            kind = REFUSALS.get(refusal.reason, Unavailable)
            raise kind(refusal.message, code=refusal.reason, retry_after_s=refusal.retry_after_s)
        metrics.REPLIES_STARTED.labels(api="openai" if not reply.conversation_id else "chat", tier=reply.user.tier.value).inc()
        if outcome.shadow_model and self._shadows is not None:
            self._shadows.start(request, outcome.shadow_model)
        model = outcome.model or reply.model
        route = reply.route.answered_by(model) if reply.route is not None else None
        if model != reply.model or route is not None:  # a stream attached later says what the first one said
            await set_answered(self._redis, reply.reply_id, model, json.dumps(route.as_dict()) if route is not None else "")
        return Begun(model, route)

    async def ask_router(self, request: GenerateRequest) -> GenerateReply:
        """The router's answer; raises Unavailable (503 with Retry-After) when none came. A request
        that may have reached a router (it timed out, or the connection failed meanwhile) is
        cancelled too, so no generation runs that nobody tracks."""
        timeout_s = self._generate_timeout_s
        if not self._bus.is_connected:  # reconnecting: nothing is sent, so nothing to cancel
            await forget_reply(self._redis, request.reply_id)
            raise Unavailable(
                "the message bus is reconnecting; try again shortly", code="bus_unavailable", retry_after_s=ROUTER_RETRY_AFTER_S
            )
        try:
            answer = await self._request_a_router(encode(request), timeout_s)
            return validate.generate_reply(answer.data)
        except nats.errors.NoRespondersError:
            message = f"no router is running (none came within {timeout_s:g} s); try again shortly"
            error = Unavailable(message, code="no_router", retry_after_s=ROUTER_RETRY_AFTER_S)
        except nats.errors.TimeoutError:
            message = f"no router answered within {timeout_s:g} s; try again shortly"
            error = Unavailable(message, code="router_timeout", retry_after_s=ROUTER_RETRY_AFTER_S)
            await self._cancel_untracked(request.reply_id)
        except (nats.errors.Error, validate.Invalid) as exc:  # what went wrong is the log's, not the client's
            why = f"{type(exc).__name__}: {exc}"
            log.warning("request %s: reply %s: the router could not be asked: %s", current_request_id(), request.reply_id, why)
            if isinstance(exc, validate.Invalid):
                validate.drop("generate_reply", subjects.GENERATE, exc)
            error = Unavailable(
                "the router could not be asked; try again shortly", code="router_unavailable", retry_after_s=ROUTER_RETRY_AFTER_S
            )
            await self._cancel_untracked(request.reply_id)
        await forget_reply(self._redis, request.reply_id)
        metrics.REPLIES_REFUSED.labels(code=error.code).inc()
        raise error

    async def _request_a_router(self, data: bytes, timeout_s: float) -> Msg:
        """The generate request's answer within `timeout_s`. While no router is subscribed (the only
        one is restarting: a rolling upgrade) the request reached none, so it is sent again, after
        a short backoff, until `timeout_s` is spent; then NoRespondersError."""
        loop = asyncio.get_running_loop()
        deadline_s = loop.time() + timeout_s
        delay_s = NO_ROUTER_FIRST_RETRY_S
        while True:
            try:
                return await self._bus.client.request(subjects.GENERATE, data, timeout=max(0.01, deadline_s - loop.time()))
            except nats.errors.NoRespondersError:
                if loop.time() + delay_s >= deadline_s:
                    raise
            metrics.GENERATE_RESENT.inc()
            await asyncio.sleep(delay_s)
            delay_s = min(2 * delay_s, NO_ROUTER_MAX_RETRY_S)

    async def _cancel_untracked(self, reply_id: str) -> None:
        try:
            await cancel_reply(self._bus, reply_id, "generate_timeout")
        except nats.errors.Error as exc:  # NATS is down: nothing reaches a router either
            log.warning("could not cancel reply %s after its generate request failed: %s", reply_id, exc or type(exc).__name__)


async def forget_reply(redis: Redis, reply_id: str) -> None:
    """A reply that never started: nothing to keep. Its log and pending events are the relay's
    (the chat's Redis user may only read them): a reply that never started has none, and what a
    late event left there expires with its TTL."""
    keys = ReplyKeys(reply_id)
    await redis.srem(RUNNING, reply_id)
    await redis.delete(keys.meta, keys.readers)


async def cancel_reply(bus: Bus, reply_id: str, reason: str) -> None:
    await bus.client.publish(subjects.cancel(reply_id), encode(Cancel(reply_id=reply_id, reason=reason)))
