"""Token quotas against the whole stack (a stack of its own, with a 6,000-unit free bucket): a
burst of 30 messages of about 900 prompt tokens from one free key, over both chat instances at
once, admits only as many as the bucket affords; the rest are 429 quota_exceeded in OpenAI's
shape with a Retry-After of minutes, and store nothing; the OpenAI endpoint refuses the same
way; every authenticated answer carries the x-ratelimit headers; and once the admitted replies
end, the relay's settlement gives back what they did not use.

The relays are paused (SIGSTOP) while the burst arrives, so no reply can end and be settled
before the last request of the burst is admitted or refused: the count is exact."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from helpers import wait_until
from product_stack import BOB, ProductStack, own_product_stack, read_stream

from tandem.quota import reservation_key

pytestmark = pytest.mark.real_model
QUOTA_FREE = 6000
MAX_ANSWER_TOKENS = 16
PROMPT = "apple " * 880  # 881 tokens; with the system prompt and the template about 905
NUM_BURST = 30
# Each message may cost about 905 + 16 x4 = 969 units: the bucket affords 6 of them.
NUM_AFFORDED = 6
FULL_REFILL_S = 10800  # the default quota_refill_s


@pytest_asyncio.fixture(scope="module")
async def quota_stack(tmp_path_factory) -> AsyncIterator[ProductStack]:
    # Streams per key unbounded here: the burst meets the quota, not the limit on open streams.
    env = {"TANDEM_QUOTA_FREE": str(QUOTA_FREE), "TANDEM_MAX_ANSWER_TOKENS": str(MAX_ANSWER_TOKENS), "TANDEM_STREAM_LIMIT_FREE": "100"}
    async with own_product_stack(tmp_path_factory.mktemp("quota"), **env) as stack:
        yield stack


async def send(client: httpx.AsyncClient, conversation_id: str, answered: asyncio.Queue[int]) -> tuple[int, httpx.Headers, object]:
    """Posts the message; (status, headers, the refusal's body or the reply's events)."""
    url = f"/v1/conversations/{conversation_id}/messages"
    async with client.stream("POST", url, headers=BOB, json={"content": PROMPT}) as response:
        await answered.put(response.status_code)
        if response.status_code != 200:
            return response.status_code, response.headers, json.loads(await response.aread())
        return 200, response.headers, await read_stream(response)


def remaining_of(headers: httpx.Headers) -> int:
    return int(headers["x-ratelimit-remaining-tokens"])


def assert_quota_refusal(status: int, headers: httpx.Headers, body: object) -> None:
    assert status == 429, (status, body)
    assert isinstance(body, dict)
    error = body["error"]
    assert (error["type"], error["code"]) == ("rate_limit_exceeded", "quota_exceeded"), error
    wait_s = int(headers["Retry-After"])
    # The bucket holds at most a few hundred units now: a worst case waits minutes, and never
    # longer than refilling it from empty would take.
    assert 60 <= wait_s <= FULL_REFILL_S * 1000 / QUOTA_FREE, wait_s
    assert re.search(r"try again in \d+ minutes", error["message"]), error["message"]
    assert remaining_of(headers) < 1000


async def test_a_burst_from_one_free_key_is_admitted_as_far_as_its_bucket_affords(quota_stack):
    clients = [httpx.AsyncClient(base_url=url, timeout=120) for url in quota_stack.chat_urls]
    try:
        models = await clients[0].get("/v1/models", headers=BOB)
        assert remaining_of(models.headers) == QUOTA_FREE and models.headers["x-ratelimit-reset-tokens"] == "0s"
        assert "x-ratelimit-remaining-tokens" not in (await clients[0].get("/v1/models")).headers, "only for a known key"
        conversation_ids = [(await clients[0].post("/v1/conversations", headers=BOB, json={})).json()["id"] for _ in range(NUM_BURST)]
        answered: asyncio.Queue[int] = asyncio.Queue()
        with quota_stack.relays_paused():
            sends = [asyncio.create_task(send(clients[i % 2], cid, answered)) for i, cid in enumerate(conversation_ids)]
            statuses = [await asyncio.wait_for(answered.get(), 60) for _ in range(NUM_BURST)]
            assert sorted(statuses) == [200] * NUM_AFFORDED + [429] * (NUM_BURST - NUM_AFFORDED)
            # The OpenAI endpoint draws on the same bucket, and refuses the same way.
            completion = await clients[1].post(
                "/v1/chat/completions", headers=BOB, json={"model": "auto", "messages": [{"role": "user", "content": PROMPT}]}
            )
            assert_quota_refusal(completion.status_code, completion.headers, completion.json())
        results = await asyncio.wait_for(asyncio.gather(*sends), 180)
        refusals = [result for result in results if result[0] != 200]
        for status, headers, body in refusals:
            assert_quota_refusal(status, headers, body)
        replies = [result for result in results if result[0] == 200]
        for _, headers, events in replies:
            assert remaining_of(headers) < QUOTA_FREE
            assert isinstance(events, list) and events[-1].event == "done", events[-1:]
        refused_ids = [cid for cid, result in zip(conversation_ids, results) if result[0] != 200]
        stored = await clients[0].get(f"/v1/conversations/{refused_ids[0]}", headers=BOB)
        assert stored.json()["messages"] == [], "a refused message stores nothing"

        # The replies ended: the relay settled each at what it used.
        redis = aioredis.from_url(quota_stack.redis_url)
        try:
            keys = [reservation_key(headers["X-Message-Id"]) for _, headers, _ in replies]
            assert await wait_until(lambda: _none_exist(redis, keys), timeout_s=30)
        finally:
            await redis.aclose()
        used = sum(cost_of(events[-1].data["usage"]) for _, _, events in replies)  # type: ignore[union-attr,index]
        remaining = remaining_of((await clients[0].get("/v1/models", headers=BOB)).headers)
        refilled = QUOTA_FREE / FULL_REFILL_S * 300  # at most, in the few minutes this test runs
        assert QUOTA_FREE - used - 1 <= remaining <= QUOTA_FREE - used + refilled, (remaining, used)
    finally:
        for client in clients:
            await client.aclose()


def cost_of(usage: dict[str, int]) -> float:
    return usage["input"] - usage["cached"] + usage["cached"] * 0.1 + usage["output"] * 4


async def _none_exist(redis: aioredis.Redis, keys: list[str]) -> bool:
    return await redis.exists(*keys) == 0
