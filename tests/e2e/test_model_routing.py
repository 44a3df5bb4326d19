"""`model: "auto"` against a stack serving two models: two decode workers load the same embedded
weights under two served names (a large and a small model, as the settings name them), with a
router, a relay and two chat instances (the built-in difficulty classifier, and none: the
fallback rule). Proves that auto sends a short greeting small and a long code question large (the
meta and done events and the stored turns say so), that a conversation stays on its model, that a
paid user's pick is honoured, and that without a classifier the fallback rule decides."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest
import pytest_asyncio
from helpers import wait_until
from product_stack import ALICE, BOB, LARGE, SMALL, TWO_MODEL_ENV, own_product_stack, read_stream, two_model_roles, wait_listed
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.real_model
ANSWER = {"temperature": 0, "max_tokens": 4}
GREETING = "Hello! How are you today?"
CODE_QUESTION = """My function crashes and I do not understand why. Explain what is wrong, step by step, and
show me a fixed version that also handles an empty list.

```python
def average(rows):
    total = 0
    for row in rows:
        total += row["value"]
    return total / len(rows)

print(average([{"value": 1}, {"value": 2}, 3]))
```

Traceback (most recent call last):
  File "avg.py", line 7, in <module>
    print(average([{"value": 1}, {"value": 2}, 3]))
  File "avg.py", line 4, in average
    total += row["value"]
TypeError: 'int' object is not subscriptable
"""
SHORT_WITH_CODE = "Why does this fail?\n```\nx = [1, 2][5]\n```"


@dataclass
class TwoModelStack:
    url: str  # chat with the built-in classifier
    fallback_url: str  # chat with TANDEM_DIFFICULTY_CLASSIFIER=none
    ops_url: str  # the first chat's ops port
    fallback_ops_url: str


@pytest_asyncio.fixture(scope="module")
async def two_models(tmp_path_factory):
    roles = two_model_roles({}, {"TANDEM_DIFFICULTY_CLASSIFIER": "none"})
    async with own_product_stack(tmp_path_factory.mktemp("two-models"), roles=roles, **TWO_MODEL_ENV) as stack:
        await wait_listed(stack, {LARGE, SMALL}, ALICE)
        chat_ops = [stack.ops_urls[instance_id] for instance_id in stack.ids["chat"]]
        yield TwoModelStack(url=stack.chat_urls[0], fallback_url=stack.chat_urls[1], ops_url=chat_ops[0], fallback_ops_url=chat_ops[1])


async def new_conversation(client: httpx.AsyncClient, headers) -> str:
    response = await client.post("/v1/conversations", headers=headers, json={})
    assert response.status_code == 201, response.text
    return response.json()["id"]


async def send(client: httpx.AsyncClient, conversation_id: str, content: str, headers, model: str = "auto") -> tuple[dict, dict]:
    """The meta and done events of one message's stream."""
    async with client.stream(
        "POST",
        f"/v1/conversations/{conversation_id}/messages",
        headers={**headers, "Accept": "text/event-stream"},
        json={"content": content, "model": model, **ANSWER},
    ) as response:
        events = await read_stream(response)
    by_name = {e.event: e.data for e in events}
    assert "done" in by_name, events
    return by_name["meta"], by_name["done"]


async def stored_turns(client: httpx.AsyncClient, conversation_id: str, headers) -> list[dict]:
    """The conversation's messages once every answer is saved (the relay's final write)."""

    async def saved():
        response = await client.get(f"/v1/conversations/{conversation_id}", headers=headers)
        messages = response.json()["messages"]
        return messages if all(m["status"] != "running" for m in messages) else None

    return await wait_until(saved, timeout_s=30)


async def scrape(client: httpx.AsyncClient, ops_url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    response = await client.get(f"{ops_url}/metrics")
    assert response.status_code == 200, response.text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


async def test_both_models_are_listed(two_models):
    async with httpx.AsyncClient(base_url=two_models.url, timeout=30) as client:
        response = await client.get("/v1/models", headers=BOB)
    assert sorted(m["id"] for m in response.json()["data"]) == [LARGE, SMALL]


async def test_auto_sends_a_greeting_small_and_a_long_code_question_large_and_the_conversation_stays(two_models):
    async with httpx.AsyncClient(base_url=two_models.url, timeout=120) as client:
        greeted = await new_conversation(client, BOB)
        meta, done = await send(client, greeted, GREETING, BOB)
        assert meta["model"] == SMALL and done["model"] == SMALL, (meta, done)
        route = meta["route"]
        assert (route["decision"], route["decided_by"]) == ("small", "classifier") and route["score"] < 0.5

        asked = await new_conversation(client, BOB)
        meta, done = await send(client, asked, CODE_QUESTION, BOB)
        assert meta["model"] == LARGE and done["model"] == LARGE, (meta, done)
        assert (meta["route"]["decision"], meta["route"]["decided_by"]) == ("large", "classifier")
        assert meta["route"]["score"] >= 0.5

        # The greeting's conversation stays on the small model, even for the hard question.
        meta, done = await send(client, greeted, CODE_QUESTION, BOB)
        assert meta["model"] == SMALL and done["model"] == SMALL
        assert (meta["route"]["decision"], meta["route"]["decided_by"], meta["route"]["score"]) == ("conversation", "conversation", None)

        assert [(m["role"], m["model"]) for m in await stored_turns(client, greeted, BOB)] == [
            ("user", SMALL),
            ("assistant", SMALL),
            ("user", SMALL),
            ("assistant", SMALL),
        ]
        assert [(m["role"], m["model"]) for m in await stored_turns(client, asked, BOB)] == [("user", LARGE), ("assistant", LARGE)]
        metrics = await scrape(client, two_models.ops_url)
    assert metrics[("tandem_chat_model_routes_total", frozenset({("model", SMALL), ("decided_by", "classifier")}))] == 1
    assert metrics[("tandem_chat_model_routes_total", frozenset({("model", SMALL), ("decided_by", "conversation")}))] == 1
    assert metrics[("tandem_chat_difficulty_score_count", frozenset())] == 2


async def test_a_paid_pick_is_honoured_and_a_free_one_is_routed(two_models):
    async with httpx.AsyncClient(base_url=two_models.url, timeout=120) as client:
        meta, done = await send(client, await new_conversation(client, ALICE), CODE_QUESTION, ALICE, model=SMALL)
        assert (meta["model"], done["model"], meta["route"]["decision"], meta["route"]["decided_by"]) == (SMALL, SMALL, "picked", "user")
        meta, _ = await send(client, await new_conversation(client, BOB), CODE_QUESTION, BOB, model=SMALL)
        assert (meta["model"], meta["route"]["decided_by"]) == (LARGE, "classifier")


async def test_without_a_classifier_the_fallback_rule_decides(two_models):
    async with httpx.AsyncClient(base_url=two_models.fallback_url, timeout=120) as client:
        meta, done = await send(client, await new_conversation(client, BOB), GREETING, BOB)
        assert (meta["model"], done["model"], meta["route"]["decided_by"], meta["route"]["score"]) == (SMALL, SMALL, "fallback", None)
        meta, done = await send(client, await new_conversation(client, BOB), SHORT_WITH_CODE, BOB)
        assert (meta["model"], done["model"], meta["route"]["decided_by"]) == (LARGE, LARGE, "fallback")
        metrics = await scrape(client, two_models.fallback_ops_url)
    assert metrics[("tandem_chat_difficulty_fallbacks_total", frozenset({("reason", "none")}))] == 2


async def test_openai_auto_is_routed_too(two_models):
    async with httpx.AsyncClient(base_url=two_models.url, timeout=120) as client:
        request = {"model": "auto", "messages": [{"role": "user", "content": GREETING}], **ANSWER}
        response = await client.post("/v1/chat/completions", headers=BOB, json=request)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == SMALL
