"""The chat's side of token quotas, on a real redis-server and nats-server: a reply the bucket
cannot afford is refused with 429 quota_exceeded and a Retry-After before anything of it is
recorded; one larger than the whole bucket is a 400 naming max_tokens; a reply the router
refuses, or that no router answers, gets its whole reservation back; and after an overload
refusal, free replies are refused at the door (no router asked, nothing reserved) while paid ones
are still asked; a reply with a quota fallback whose main bucket is spent starts its fallback
from the small model's bucket, and only that bucket's exhaustion (or a tier that does not fall
back) is the 429."""

from __future__ import annotations

import types
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from services.chat.door import Door
from services.chat.errors import InvalidRequest, RateLimited, Unavailable, answer
from services.chat.replies import ReplyRequest, ReplyStarter
from tandem.bus import Bus, BusConfig, encode, subjects
from tandem.config import ApiKey, Tier
from tandem.quota import Bucket, QuotaConfig, TokenBuckets, reservation_key
from tandem.tokenlog import ReplyKeys
from tandem.v1.common_pb2 import LANE_FREE, LANE_PAID, SamplingParams
from tandem.v1.generate_pb2 import GenerateReply, GenerateRequest, Refusal

QUOTA = QuotaConfig(
    capacity_free=6000,
    capacity_plus=60000,
    capacity_pro=600000,
    refill_s=600.0,
    reservation_ttl_s=120,
    small_capacity_free=3000,
    small_capacity_pro=3000,
    fallback_tiers=frozenset({Tier.FREE}),
)


@pytest_asyncio.fixture
async def state(redis_server, nats_server) -> AsyncIterator[types.SimpleNamespace]:
    """What starts a reply: Redis, the bus, the door, the buckets, the generate timeout."""
    bus = Bus(BusConfig(url=nats_server.url, name="test-chat-quota"))
    bus.start()
    await bus.wait_connected()
    redis = aioredis.from_url(redis_server.url, socket_timeout=10)
    quotas = TokenBuckets(redis, QUOTA)
    starter = ReplyStarter(redis, bus, Door(), quotas, generate_timeout_s=2.0)
    yield types.SimpleNamespace(redis=redis, bus=bus, quotas=quotas, starter=starter)
    await redis.aclose()
    await bus.close()


def reply_request(user: ApiKey, num_prompt_tokens: int, max_tokens: int) -> ReplyRequest:
    return ReplyRequest(uuid.uuid4().hex, user, "m", list(range(num_prompt_tokens)), 0, SamplingParams(max_tokens=max_tokens))


def free_user() -> ApiKey:
    return ApiKey(user_id=uuid.uuid4().hex, tier=Tier.FREE)


async def test_a_reply_the_bucket_cannot_afford_is_429_with_retry_after_and_nothing_recorded(state):
    user = free_user()
    await state.quotas.reserve(user.user_id, Tier.FREE, 5500, uuid.uuid4().hex)  # 500 left, 10 units a second
    reply = reply_request(user, 900, 48)  # up to 1092
    with pytest.raises(RateLimited) as refused:
        await state.starter.start_reply(reply)
    assert refused.value.code == "quota_exceeded"
    wait_s = refused.value.retry_after_s
    assert 55 <= wait_s <= 60  # (1092 - 500) / 10, rounded up, less what refilled meanwhile
    assert f"try again in {wait_s:.0f} seconds" in refused.value.message
    response = await answer(None, refused.value)  # type: ignore[arg-type]
    assert (response.status_code, response.headers["Retry-After"]) == (429, f"{wait_s:.0f}")
    assert b'"type":"rate_limit_exceeded"' in response.body
    assert await state.redis.exists(*ReplyKeys(reply.reply_id).all(), reservation_key(reply.reply_id)) == 0


async def test_a_reply_larger_than_the_whole_bucket_is_a_400_naming_max_tokens(state):
    with pytest.raises(InvalidRequest) as refused:
        await state.starter.start_reply(reply_request(free_user(), 900, 1300))  # 6100 > 6000
    assert (refused.value.code, refused.value.param) == ("exceeds_quota", "max_tokens")


async def test_a_reply_the_router_refuses_gets_its_reservation_back(state):
    async def refusing_router(msg) -> None:
        await msg.respond(encode(GenerateReply(refused=Refusal(reason="overloaded", message="full", retry_after_s=1.0))))

    router = await state.bus.client.subscribe(subjects.GENERATE, queue="router", cb=refusing_router)
    user = free_user()
    try:
        with pytest.raises(Unavailable):
            await state.starter.start_reply(reply_request(user, 900, 48))
    finally:
        await router.unsubscribe()
    assert (await state.quotas.peek(user.user_id, Tier.FREE)).remaining_units == 6000


async def test_a_reply_no_router_answers_gets_its_reservation_back(state):
    user = free_user()
    with pytest.raises(Unavailable) as refused:
        await state.starter.start_reply(reply_request(user, 900, 48))
    assert refused.value.code == "no_router"
    assert (await state.quotas.peek(user.user_id, Tier.FREE)).remaining_units == 6000


async def test_an_accepted_reply_keeps_its_reservation_for_the_relay_to_settle(state):
    async def accepting_router(msg) -> None:
        await msg.respond(encode(GenerateReply(reply_id="accepted")))

    router = await state.bus.client.subscribe(subjects.GENERATE, queue="router", cb=accepting_router)
    user = free_user()
    reply = reply_request(user, 900, 48)
    try:
        await state.starter.start_reply(reply)
    finally:
        await router.unsubscribe()
    assert (await state.quotas.reservation(reply.reply_id)).units == 1092
    assert (await state.quotas.peek(user.user_id, Tier.FREE)).remaining_units == pytest.approx(6000 - 1092, abs=1)


async def test_after_an_overload_refusal_free_replies_are_refused_at_the_door_and_paid_ones_still_asked(state):
    asked: list[int] = []

    async def refusing_router(msg) -> None:
        asked.append(GenerateRequest.FromString(msg.data).lane)
        await msg.respond(encode(GenerateReply(refused=Refusal(reason="overloaded", message="full", retry_after_s=30.0))))

    router = await state.bus.client.subscribe(subjects.GENERATE, queue="router", cb=refusing_router)
    first, second = free_user(), free_user()
    try:
        with pytest.raises(Unavailable):
            await state.starter.start_reply(reply_request(first, 900, 48))
        with pytest.raises(Unavailable) as at_door:
            await state.starter.start_reply(reply_request(second, 900, 48))
        with pytest.raises(Unavailable):
            await state.starter.start_reply(reply_request(ApiKey(user_id=f"p-{uuid.uuid4().hex[:6]}", tier=Tier.PLUS), 900, 48))
    finally:
        await router.unsubscribe()
    assert asked == [LANE_FREE, LANE_PAID], "the second free reply never reached a router"
    assert at_door.value.code == "overloaded" and 25 < at_door.value.retry_after_s <= 30
    assert (await state.quotas.peek(second.user_id, Tier.FREE)).remaining_units == 6000


def choices_of(user: ApiKey, n: int, num_prompt_tokens: int, max_tokens: int) -> list[ReplyRequest]:
    first = reply_request(user, num_prompt_tokens, max_tokens)
    return [first, *(replace(first, reply_id=f"{first.reply_id}-{i}") for i in range(1, n))]


async def test_n_choices_reserve_n_replies_worst_cases_and_the_rest_are_asked_for_after_the_first_is_computed(state):
    asked: list[str] = []
    computed: list[str] = []

    async def accepting_router(msg) -> None:
        asked.append(GenerateRequest.FromString(msg.data).reply_id)
        await msg.respond(encode(GenerateReply(reply_id="accepted")))

    async def prompt_cached(reply_id: str) -> None:
        computed.append(reply_id)
        assert asked == [reply_id], "only the first choice is asked for before its prompt is computed"

    router = await state.bus.client.subscribe(subjects.GENERATE, queue="router", cb=accepting_router)
    user = free_user()
    choices = choices_of(user, 3, 900, 48)
    try:
        await state.starter.start_choices(choices, prompt_cached)
    finally:
        await router.unsubscribe()
    assert computed == [choices[0].reply_id] and asked == [c.reply_id for c in choices]
    assert [(await state.quotas.reservation(c.reply_id)).units for c in choices] == [1092] * 3
    assert (await state.quotas.peek(user.user_id, Tier.FREE)).remaining_units == pytest.approx(6000 - 3 * 1092, abs=1)


async def test_n_choices_the_bucket_affords_only_some_of_start_none(state):
    async def unused(reply_id: str) -> None:
        raise AssertionError("nothing may start")

    user = free_user()
    await state.quotas.reserve(user.user_id, Tier.FREE, 3500, uuid.uuid4().hex)  # 2500 left: two choices of 1092, not three
    choices = choices_of(user, 3, 900, 48)
    with pytest.raises(RateLimited):
        await state.starter.start_choices(choices, unused)
    for choice in choices:
        assert await state.redis.exists(*ReplyKeys(choice.reply_id).all(), reservation_key(choice.reply_id)) == 0
    assert (await state.quotas.peek(user.user_id, Tier.FREE)).remaining_units == pytest.approx(2500, abs=2)


async def test_a_choice_the_router_refuses_cancels_the_choices_begun_and_gives_every_reservation_back(state):
    asked: list[str] = []

    async def second_refused(msg) -> None:
        asked.append(GenerateRequest.FromString(msg.data).reply_id)
        if len(asked) == 1:
            await msg.respond(encode(GenerateReply(reply_id="accepted")))
        else:
            await msg.respond(encode(GenerateReply(refused=Refusal(reason="bad_request", message="no"))))

    async def computed(reply_id: str) -> None:
        return None

    user = ApiKey(user_id=f"p-{uuid.uuid4().hex[:6]}", tier=Tier.PLUS)
    choices = choices_of(user, 3, 900, 48)
    router = await state.bus.client.subscribe(subjects.GENERATE, queue="router", cb=second_refused)
    cancels = await state.bus.client.subscribe(subjects.cancel(choices[0].reply_id))
    try:
        with pytest.raises(InvalidRequest):
            await state.starter.start_choices(choices, computed)
        assert (await cancels.next_msg(timeout=5)).subject == subjects.cancel(choices[0].reply_id)
    finally:
        await router.unsubscribe()
        await cancels.unsubscribe()
    assert asked == [c.reply_id for c in choices[:2]], "the third is never asked for"
    assert (await state.quotas.peek(user.user_id, Tier.PLUS)).remaining_units == pytest.approx(60000, abs=2)


def with_fallback(reply: ReplyRequest) -> ReplyRequest:
    return replace(reply, fallback=replace(reply, model="small"))


async def test_a_spent_quota_starts_the_fallback_from_the_small_bucket_until_that_is_spent_too(state):
    asked: list[str] = []

    async def accepting_router(msg) -> None:
        request = GenerateRequest.FromString(msg.data)
        asked.append(request.model)
        await msg.respond(encode(GenerateReply(reply_id=request.reply_id, model=request.model)))

    router = await state.bus.client.subscribe(subjects.GENERATE, queue="router", cb=accepting_router)
    user = free_user()
    await state.quotas.reserve(user.user_id, Tier.FREE, 5500, uuid.uuid4().hex)  # 500 left in the main bucket
    try:
        first, second, third = (with_fallback(reply_request(user, 900, 48)) for _ in range(3))  # up to 1092 each
        assert (await state.starter.start_reply(first)).model == "small"
        assert (await state.starter.start_reply(second)).model == "small"
        with pytest.raises(RateLimited) as refused:  # 3000 - 2 x 1092 = 816 left in the small bucket
            await state.starter.start_reply(third)
    finally:
        await router.unsubscribe()
    assert asked == ["small", "small"]
    assert refused.value.code == "quota_exceeded" and "small-model quota" in refused.value.message
    assert (await state.quotas.reservation(first.reply_id)).bucket is Bucket.SMALL
    assert (await state.quotas.peek(user.user_id, Tier.FREE)).remaining_units < 600  # the main bucket untouched by them
    assert await state.redis.exists(*ReplyKeys(third.reply_id).all(), reservation_key(third.reply_id)) == 0


async def test_a_tier_that_does_not_fall_back_gets_the_429_even_with_a_fallback(state):
    user = ApiKey(user_id=uuid.uuid4().hex, tier=Tier.PRO)
    await state.quotas.reserve(user.user_id, Tier.PRO, 600000, uuid.uuid4().hex)
    with pytest.raises(RateLimited) as refused:
        await state.starter.start_reply(with_fallback(reply_request(user, 900, 48)))
    assert refused.value.code == "quota_exceeded"
    assert (await state.quotas.peek(user.user_id, Tier.PRO, Bucket.SMALL)).remaining_units == 3000


async def test_a_fallback_that_never_starts_gives_the_small_bucket_its_units_back(state):
    user = free_user()
    await state.quotas.reserve(user.user_id, Tier.FREE, 6000, uuid.uuid4().hex)
    with pytest.raises(Unavailable):  # no router runs
        await state.starter.start_reply(with_fallback(reply_request(user, 900, 48)))
    assert (await state.quotas.peek(user.user_id, Tier.FREE, Bucket.SMALL)).remaining_units == 3000
