"""The quota fallback against a stack serving two models (two decode workers load the same
embedded weights under a large and a small name) with a tiny free quota: a free user's first
long message is answered large; past the quota the next is answered by the small model from its
own bucket, and the meta event, the done event and the stored turn say so; an OpenAI request for
`auto` falls back too (its `model` and X-Tandem-Routed-By say so) while one naming the large
model gets the 429; once the small bucket is spent as well, the next message is 429
quota_exceeded.

Every message is about 225 prompt tokens with a worst case of about 241 units (max_tokens 4 x4):
the main bucket (300) affords one, the small bucket (500) two. The chat decides by the fallback
rule (no classifier), which sends a long message large."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
import pytest_asyncio
from helpers import wait_until
from product_stack import BOB, LARGE, SMALL, TWO_MODEL_ENV, own_product_stack, read_stream, two_model_roles, wait_listed

pytestmark = pytest.mark.real_model
PROMPT = "apple " * 200  # about 225 tokens with the system prompt and the template: a large message by the fallback rule
QUOTA_FREE, QUOTA_SMALL_FREE = 300, 500


@pytest_asyncio.fixture(scope="module")
async def fallback_stack(tmp_path_factory) -> AsyncIterator[str]:
    """The chat's URL; the stack: nats, redis, a router, the two decode workers, a relay, a chat."""
    env = {**TWO_MODEL_ENV, "TANDEM_QUOTA_FREE": str(QUOTA_FREE), "TANDEM_QUOTA_SMALL_FREE": str(QUOTA_SMALL_FREE)}
    roles = two_model_roles({"TANDEM_DIFFICULTY_CLASSIFIER": "none"})
    async with own_product_stack(tmp_path_factory.mktemp("quota-fallback"), roles=roles, **env) as stack:
        await wait_listed(stack, {LARGE, SMALL}, BOB)
        yield stack.url


async def send(client: httpx.AsyncClient) -> tuple[int, dict]:
    """Posts PROMPT to a new conversation: (200, its events by name and the conversation id) or (status, the error body)."""
    created = await client.post("/v1/conversations", headers=BOB, json={})
    assert created.status_code == 201, created.text
    conversation_id = created.json()["id"]
    url = f"/v1/conversations/{conversation_id}/messages"
    body = {"content": PROMPT, "model": "auto", "temperature": 0}
    async with client.stream("POST", url, headers={**BOB, "Accept": "text/event-stream"}, json=body) as response:
        if response.status_code != 200:
            return response.status_code, json.loads(await response.aread())
        events = await read_stream(response)
    by_name = {e.event: e.data for e in events}
    assert "done" in by_name, events
    return 200, {**by_name, "conversation_id": conversation_id}


async def stored_answer_model(client: httpx.AsyncClient, conversation_id: str) -> str:
    async def saved():
        response = await client.get(f"/v1/conversations/{conversation_id}", headers=BOB)
        messages = response.json()["messages"]
        return messages if messages[-1]["status"] == "complete" else None

    messages = await wait_until(saved, timeout_s=30)
    return messages[-1]["model"]


async def test_a_free_user_past_the_quota_is_answered_by_the_small_model_until_its_bucket_is_spent(fallback_stack):
    async with httpx.AsyncClient(base_url=fallback_stack, timeout=120) as client:
        status, first = await send(client)
        assert status == 200, first
        assert first["meta"]["model"] == LARGE and first["meta"]["route"]["decided_by"] == "fallback", first["meta"]

        # The main bucket is spent: an OpenAI request naming the large model is refused, not moved.
        named = {"model": LARGE, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
        refused = await client.post("/v1/chat/completions", headers=BOB, json=named)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "quota_exceeded"

        status, second = await send(client)
        assert status == 200, second
        meta = second["meta"]
        assert meta["model"] == SMALL, meta
        assert (meta["route"]["decision"], meta["route"]["decided_by"], meta["route"]["instead_of"]) == ("small", "quota_fallback", LARGE)
        assert await stored_answer_model(client, second["conversation_id"]) == SMALL

        auto = {"model": "auto", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4}
        answered = await client.post("/v1/chat/completions", headers=BOB, json=auto)
        assert answered.status_code == 200, answered.text
        assert answered.json()["model"] == SMALL
        assert answered.headers["X-Tandem-Routed-By"] == "quota_fallback"

        # The small bucket (500) has paid for two worst cases of about 241: the next is the 429.
        status, third = await send(client)
        assert status == 429, third
        assert third["error"]["code"] == "quota_exceeded" and "small-model quota" in third["error"]["message"], third
