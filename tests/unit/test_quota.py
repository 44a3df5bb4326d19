"""The token bucket's arithmetic, run where it runs (Lua scripts in a real redis-server), on an
injected clock: refill, reservations that fit and that do not (and when they would), settling,
refunds, the capacity cap, settling twice, and the expiry of every key; the small model's bucket
(the quota fallback's) kept apart from the main one, each settled into the one it came from."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from tandem.config import Tier
from tandem.quota import Bucket, ExceedsCapacity, QuotaConfig, TokenBuckets, bucket_key, cost_units, reservation_key, worst_case_units
from tandem.v1.common_pb2 import Usage

CONFIG = QuotaConfig(
    capacity_free=6000,
    capacity_plus=60000,
    capacity_pro=600000,
    refill_s=600.0,
    reservation_ttl_s=120,
    small_capacity_free=3000,
    small_capacity_plus=30000,
    fallback_tiers=frozenset({Tier.FREE, Tier.PLUS, Tier.PRO}),
)
RATE_PER_S = 10.0  # the free bucket: 6000 units in 600 s


class Clock:
    def __init__(self) -> None:
        self.now_ms = 1_700_000_000_000

    def __call__(self) -> int:
        return self.now_ms

    def advance(self, seconds: float) -> None:
        self.now_ms += round(seconds * 1000)


@pytest_asyncio.fixture
async def redis(redis_server):
    client = aioredis.from_url(redis_server.url, socket_timeout=10)
    yield client
    await client.aclose()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def buckets(redis, clock) -> TokenBuckets:
    return TokenBuckets(redis, CONFIG, clock)


def new_id() -> str:
    return uuid.uuid4().hex


def test_cost_weighs_uncached_input_once_cached_a_tenth_and_output_four_times():
    assert cost_units(Usage(input_tokens=1000, cached_tokens=600, output_tokens=50)) == pytest.approx(400 + 60 + 200)
    assert worst_case_units(900, 48) == 900 + 192


async def test_a_new_user_has_a_full_bucket(buckets):
    level = await buckets.peek(new_id(), Tier.FREE)
    assert (level.remaining_units, level.full_in_s) == (6000, 0)


async def test_reservations_are_admitted_until_the_bucket_cannot_hold_the_next(buckets):
    user = new_id()
    admitted = [(await buckets.reserve(user, Tier.FREE, 1500, new_id())).is_admitted for _ in range(5)]
    assert admitted == [True, True, True, True, False]
    assert (await buckets.peek(user, Tier.FREE)).remaining_units == 0


async def test_a_refusal_says_when_the_bucket_will_hold_the_worst_case(buckets):
    user = new_id()
    assert (await buckets.reserve(user, Tier.FREE, 5000, new_id())).is_admitted
    refused = await buckets.reserve(user, Tier.FREE, 3000, new_id())
    assert not refused.is_admitted
    assert refused.remaining_units == 1000
    assert refused.retry_after_s == pytest.approx(2000 / RATE_PER_S)


async def test_the_bucket_refills_linearly_and_admits_once_it_holds_the_worst_case(buckets, clock):
    user = new_id()
    await buckets.reserve(user, Tier.FREE, 6000, new_id())
    clock.advance(100)
    level = await buckets.peek(user, Tier.FREE)
    assert level.remaining_units == pytest.approx(1000)
    assert level.full_in_s == pytest.approx(500)
    refused = await buckets.reserve(user, Tier.FREE, 3000, new_id())
    assert refused.retry_after_s == pytest.approx(200)
    clock.advance(refused.retry_after_s)
    assert (await buckets.reserve(user, Tier.FREE, 3000, new_id())).is_admitted


async def test_concurrent_reservations_never_overdraw_the_bucket(redis_server, clock):
    user = new_id()
    clients = [aioredis.from_url(redis_server.url, socket_timeout=10) for _ in range(3)]
    instances = [TokenBuckets(client, CONFIG, clock) for client in clients]  # three chat instances
    admissions = await asyncio.gather(*(instances[i % 3].reserve(user, Tier.FREE, 1092, new_id()) for i in range(30)))
    for client in clients:
        await client.aclose()
    assert sum(a.is_admitted for a in admissions) == 6000 // 1092
    assert all(a.retry_after_s > 0 for a in admissions if not a.is_admitted)


async def test_a_worst_case_larger_than_the_whole_bucket_can_never_fit(buckets):
    with pytest.raises(ExceedsCapacity) as raised:
        await buckets.reserve(new_id(), Tier.FREE, 6001, new_id())
    assert (raised.value.capacity_units, raised.value.tier) == (6000, Tier.FREE)


async def test_settling_charges_the_actual_cost_and_gives_back_the_rest(buckets, redis):
    user, reply_id = new_id(), new_id()
    await buckets.reserve(user, Tier.FREE, worst_case_units(1000, 500), reply_id, num_prompt_tokens=1000)  # 3000
    back = await buckets.settle(reply_id, Usage(input_tokens=1000, cached_tokens=500, output_tokens=100))  # 500 + 50 + 400
    assert back == pytest.approx(3000 - 950)
    assert (await buckets.peek(user, Tier.FREE)).remaining_units == pytest.approx(6000 - 950)
    assert await redis.exists(reservation_key(reply_id)) == 0


async def test_settling_twice_or_an_unknown_reply_changes_nothing(buckets):
    user, reply_id = new_id(), new_id()
    await buckets.reserve(user, Tier.FREE, 3000, reply_id)
    usage = Usage(input_tokens=100, output_tokens=100)
    assert await buckets.settle(reply_id, usage) == pytest.approx(2500)
    assert await buckets.settle(reply_id, usage) is None
    assert await buckets.refund(reply_id) is None
    assert await buckets.settle(new_id(), usage) is None
    assert (await buckets.peek(user, Tier.FREE)).remaining_units == pytest.approx(5500)


async def test_a_refund_gives_the_whole_reservation_back_but_never_above_capacity(buckets, clock):
    user, first, second = new_id(), new_id(), new_id()
    await buckets.reserve(user, Tier.FREE, 4000, first)
    await buckets.reserve(user, Tier.FREE, 2000, second)
    assert await buckets.refund(first) == 4000
    clock.advance(500)  # 5000 units refilled: the bucket was full again before the second comes back
    assert await buckets.refund(second) == 2000
    assert (await buckets.peek(user, Tier.FREE)).remaining_units == 6000


async def test_a_reply_costing_more_than_its_reservation_is_charged_the_reservation(buckets):
    user, reply_id = new_id(), new_id()
    await buckets.reserve(user, Tier.FREE, 1000, reply_id)
    assert await buckets.settle(reply_id, Usage(input_tokens=900, output_tokens=900)) == 0
    assert (await buckets.peek(user, Tier.FREE)).remaining_units == 5000


async def test_an_end_without_usage_is_charged_its_prompt_and_the_tokens_it_delivered(buckets):
    user, reply_id = new_id(), new_id()
    await buckets.reserve(user, Tier.FREE, worst_case_units(700, 300), reply_id, num_prompt_tokens=700)
    assert await buckets.settle_final(reply_id, Usage(), num_output_tokens=20) == pytest.approx(1900 - 780)


async def test_a_retried_reservation_under_the_same_reply_takes_nothing_more(buckets):
    user, reply_id = new_id(), new_id()
    await buckets.reserve(user, Tier.FREE, 2000, reply_id)
    assert (await buckets.reserve(user, Tier.FREE, 2000, reply_id)).is_admitted
    assert (await buckets.peek(user, Tier.FREE)).remaining_units == 4000


async def test_every_key_expires_the_bucket_when_it_would_be_full(buckets, redis, clock):
    user, reply_id = new_id(), new_id()
    await buckets.reserve(user, Tier.FREE, 1000, reply_id)
    assert 0 < await redis.ttl(reservation_key(reply_id)) <= CONFIG.reservation_ttl_s
    assert await redis.pttl(bucket_key(user)) == pytest.approx(1000 / RATE_PER_S * 1000, abs=5)
    clock.advance(30)
    await buckets.settle(reply_id, Usage(input_tokens=10, output_tokens=10))  # 50 spent, 300 refilled since
    assert await redis.exists(bucket_key(user)) == 0  # full again: no key


async def test_an_unsettled_reservation_expires_with_its_units_spent(buckets, redis):
    user, reply_id = new_id(), new_id()
    await buckets.reserve(user, Tier.FREE, 1000, reply_id)
    await redis.delete(reservation_key(reply_id))  # what its expiry does
    assert await buckets.settle(reply_id, Usage()) is None
    assert (await buckets.peek(user, Tier.FREE)).remaining_units == 5000


async def test_tiers_have_their_own_capacity(buckets):
    user = new_id()
    assert (await buckets.reserve(user, Tier.PLUS, 50000, new_id())).is_admitted
    assert (await buckets.peek(user, Tier.PLUS)).remaining_units == 10000


async def test_the_small_models_bucket_is_a_key_of_its_own_with_its_own_capacity(buckets, redis):
    user = new_id()
    assert bucket_key(user, Bucket.SMALL) != bucket_key(user)
    await buckets.reserve(user, Tier.FREE, 6000, new_id())  # the main bucket is empty
    assert not (await buckets.reserve(user, Tier.FREE, 100, new_id())).is_admitted
    assert (await buckets.reserve(user, Tier.FREE, 2500, new_id(), bucket=Bucket.SMALL)).is_admitted
    assert (await buckets.peek(user, Tier.FREE, Bucket.SMALL)).remaining_units == 500
    assert not (await buckets.reserve(user, Tier.FREE, 600, new_id(), bucket=Bucket.SMALL)).is_admitted
    with pytest.raises(ExceedsCapacity):
        await buckets.reserve(user, Tier.FREE, 3001, new_id(), bucket=Bucket.SMALL)
    assert 0 < await redis.pttl(bucket_key(user, Bucket.SMALL)) <= 600_000  # it expires when it would be full


async def test_settling_gives_the_rest_back_to_the_bucket_the_reservation_came_from(buckets):
    user, reply_id = new_id(), new_id()
    await buckets.reserve(user, Tier.FREE, 1000, new_id())
    await buckets.reserve(user, Tier.FREE, 2000, reply_id, bucket=Bucket.SMALL)
    assert (await buckets.reservation(reply_id)).bucket is Bucket.SMALL
    assert await buckets.settle(reply_id, Usage(input_tokens=100, output_tokens=100)) == pytest.approx(1500)
    assert (await buckets.peek(user, Tier.FREE, Bucket.SMALL)).remaining_units == pytest.approx(2500)
    assert (await buckets.peek(user, Tier.FREE)).remaining_units == 5000  # the main one untouched


def test_a_tier_falls_back_only_when_it_is_on_and_its_small_bucket_holds_anything():
    assert CONFIG.falls_back(Tier.FREE) and CONFIG.falls_back(Tier.PLUS)
    assert not CONFIG.falls_back(Tier.PRO)  # no small bucket
    assert not QuotaConfig(6000, 60000, 600000, 600.0, 120, small_capacity_free=3000).falls_back(Tier.FREE)  # not on
